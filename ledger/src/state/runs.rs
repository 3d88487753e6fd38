//! Runs: placing a workload, asking it to stop, and the ends its node reports (stopped,
//! finished, requeued), with the GPUs each holds and gives back.

use super::*;

impl State {
    /// Resolves and checks a placement against the workload and the cluster.
    pub(super) fn check_placement(
        &self,
        w: &Workload,
        placement: &[PlacedNode],
    ) -> Result<Vec<Part>, Rejection> {
        let mismatch = |got: String| Rejection::PlacementShapeMismatch {
            nodes: w.nodes,
            gpus_per_node: w.gpus_per_node,
            got,
        };
        if placement.len() != w.nodes as usize {
            return Err(mismatch(format!("{} nodes", placement.len())));
        }
        let mut parts: Vec<Part> = Vec::with_capacity(placement.len());
        for p in placement {
            let idx = self.node_idx(&p.node)?;
            if parts.iter().any(|q| q.node == idx) {
                return Err(mismatch(format!("node {:?} twice", p.node)));
            }
            let node = self.cluster.node(idx);
            if node.draining {
                return Err(Rejection::NodeDraining {
                    node: p.node.clone(),
                });
            }
            if let Some(m) = w.model {
                if node.model_idx != m {
                    return Err(Rejection::GpuModelMismatch {
                        node: p.node.clone(),
                        has: node.model.clone(),
                        model: self.cluster.models[m as usize].model.clone(),
                    });
                }
            }
            let mut mask = 0u64;
            for &g in &p.gpus {
                if g >= node.gpu_count {
                    return Err(Rejection::UnknownGpu {
                        node: p.node.clone(),
                        gpu: g,
                    });
                }
                mask |= 1 << g;
            }
            if p.gpus.len() != w.gpus_per_node as usize || mask.count_ones() != w.gpus_per_node {
                return Err(mismatch(format!(
                    "{} distinct GPUs on node {:?}",
                    mask.count_ones(),
                    p.node
                )));
            }
            if let Some(g) = (0..node.gpu_count).find(|&g| node.used & mask & (1 << g) != 0) {
                return Err(Rejection::GpuTaken {
                    node: p.node.clone(),
                    gpu: g,
                    holder: node.holder(g).expect("used GPUs have holders"),
                });
            }
            if let Some(g) = (0..node.gpu_count).find(|&g| mask & !node.healthy & (1 << g) != 0) {
                return Err(Rejection::GpuUnhealthy {
                    node: p.node.clone(),
                    gpu: g,
                });
            }
            parts.push(Part {
                node: idx,
                gpus: mask & mask_of(node.gpu_count),
            });
        }
        Ok(parts)
    }

    /// Checks a start at `now`: the placement, resolved.
    pub(super) fn check_started(
        &self,
        e: &WorkloadStarted,
        now: u64,
    ) -> Result<Vec<Part>, Rejection> {
        let w = self.expect_phase(e.workload, Phase::Pending)?;
        let parts = self.check_placement(w, &e.placement)?;
        if e.protected_until_ms < now {
            return Err(Rejection::ProtectedUntilBeforeStart {
                protected_until_ms: e.protected_until_ms,
                started_at_ms: now,
            });
        }
        if e.protected_until_ms - now > self.config.min_runtime_cap_ms {
            return Err(Rejection::ProtectionAboveCap {
                protected_until_ms: e.protected_until_ms,
                cap_s: self.config.min_runtime_cap_ms / 1000,
            });
        }
        if let Some(a) = w.allocation {
            for anc in self.allocations.ancestors(a) {
                let node = self.allocations.node(anc);
                if let Some(max) = node.max_gpus {
                    let held = self.allocations.held_in_subtree(anc);
                    if held + w.gpus() > u64::from(max) {
                        return Err(Rejection::AllocationCapExceeded {
                            path: node.path.clone(),
                            max_gpus: max,
                            held,
                            asked: w.gpus(),
                        });
                    }
                }
            }
        }
        Ok(parts)
    }

    pub(super) fn workload_started(&mut self, e: &WorkloadStarted) -> Result<Outcome, Rejection> {
        let parts = self.check_started(e, self.now_ms)?;
        let w = &self.workloads[&e.workload];
        let (id, gpus, alloc) = (w.id, w.gpus(), w.allocation);
        let hold = Hold {
            allocation: alloc,
            protected_until_ms: e.protected_until_ms,
            ends_ms: w
                .duration_estimate_ms
                .map(|d| self.now_ms.saturating_add(d).saturating_sub(w.work_done_ms)),
            grace_until_ms: None,
            borrowed: e.borrowed,
            preemptions: w.preemptions,
        };
        let checkpoint_ms = w.checkpoint_ms;
        self.dequeue(id);
        for part in &parts {
            self.cluster.update(part.node, |n| {
                n.used |= part.gpus;
                n.tenants.push(Tenant {
                    workload: id,
                    gpus: part.gpus,
                    hold,
                    started_at_ms: self.now_ms,
                    checkpoint_ms,
                    total_gpus: gpus,
                });
            });
        }
        match alloc {
            Some(a) => self.allocations.node_mut(a).held_gpus += gpus,
            None => self.unallocated_held_gpus += gpus,
        }
        self.adjust_delivering(alloc, gpus as i64);
        self.running.insert(id);
        self.running_with_estimate += u64::from(hold.ends_ms.is_some());
        let now = self.now_ms;
        let w = self.workloads.get_mut(&id).expect("checked");
        w.phase = Phase::Running;
        w.placement = parts;
        w.started_at_ms = now;
        w.protected_until_ms = e.protected_until_ms;
        w.borrowed = e.borrowed;
        if let Some(b) = e.borrowed {
            for p in &w.placement {
                self.lent.insert((b.reserved_for, b.until_ms, p.node, id));
                *self.leaving_nodes.entry(p.node).or_default() += 1;
            }
        }
        w.starts += 1;
        self.contracts.insert(w);
        Ok(Outcome::Applied)
    }

    pub(super) fn holds_unhealthy_gpu(&self, w: &Workload) -> bool {
        w.placement
            .iter()
            .any(|p| p.gpus & !self.cluster.node(p.node).healthy != 0)
    }

    /// Checks a preemption at `now`: the workload runs, is not being preempted, and its
    /// contract allows it.
    pub(super) fn check_preemption(
        &self,
        e: &PreemptionRequested,
        now: u64,
    ) -> Result<(), Rejection> {
        let w = self.expect_phase(e.workload, Phase::Running)?;
        if w.preempting.is_some() {
            return Err(Rejection::AlreadyPreempting {
                workload: e.workload,
            });
        }
        let contract_applies = match e.reason {
            PreemptionReason::HardwareFailure => !self.holds_unhealthy_gpu(w),
            PreemptionReason::UserCancelled => false,
            PreemptionReason::FairShare
            | PreemptionReason::Opportunistic
            | PreemptionReason::Reclaimed
            | PreemptionReason::Defragment => w.allocation.is_some(),
        };
        // Borrowed GPUs are taken back on the borrowing's term; anything else waits for the
        // contract.
        let until_ms = match (e.reason, w.borrowed) {
            (PreemptionReason::Reclaimed, Some(b)) => b.until_ms,
            _ => w.protected_until_ms,
        };
        if contract_applies && now < until_ms {
            return Err(Rejection::ContractProtected {
                workload: e.workload,
                protected_until_ms: until_ms,
            });
        }
        Ok(())
    }

    pub(super) fn preemption_requested(
        &mut self,
        e: &PreemptionRequested,
    ) -> Result<Outcome, Rejection> {
        self.check_preemption(e, self.now_ms)?;
        let alloc = self.workloads[&e.workload].allocation;
        let now = self.now_ms;
        if e.reason == PreemptionReason::FairShare {
            let beneficiary = e
                .beneficiary
                .and_then(|b| self.workloads.get(&b))
                .and_then(|b| b.allocation);
            if let (Some(b), Some(v)) = (beneficiary, alloc) {
                self.fair_share_last.insert((b, v), now);
            }
        }
        let w = self.workloads.get_mut(&e.workload).expect("checked");
        self.contracts.remove(w);
        self.preempting.insert(w.id);
        for p in &w.placement {
            if let Some(b) = w.borrowed {
                self.lent
                    .remove(&(b.reserved_for, b.until_ms, p.node, w.id));
            }
            *self.leaving_nodes.entry(p.node).or_default() += 1;
        }
        let grace_until_ms = now.saturating_add(e.grace_s.saturating_mul(1000));
        w.preempting = Some(Preempting {
            requested_at_ms: now,
            grace_until_ms,
            reason: e.reason,
            beneficiary: e.beneficiary,
        });
        // A cancel by the owner stops the work as a preemption does, but it is the owner's
        // choice, not the scheduler's: it is counted apart.
        let cancel = e.reason == PreemptionReason::UserCancelled;
        if !cancel {
            w.preemptions += 1;
        }
        for part in &w.placement {
            let node = &mut self.cluster.nodes[part.node as usize];
            for t in node.tenants.iter_mut().filter(|t| t.workload == w.id) {
                t.hold.grace_until_ms = Some(grace_until_ms);
                t.hold.preemptions = w.preemptions;
            }
        }
        if let Some(a) = alloc {
            let a = self.allocations.node_mut(a);
            if cancel {
                a.cancels += 1;
            } else {
                a.preemptions += 1;
            }
        }
        if cancel {
            self.counters.cancels += 1;
        } else {
            self.counters.preemptions += 1;
        }
        Ok(Outcome::Applied)
    }

    /// Frees a running workload's GPUs and records its run.
    pub(super) fn release(&mut self, id: WorkloadId) {
        let now = self.now_ms;
        let w = self.workloads.get_mut(&id).expect("caller checked");
        let parts = std::mem::take(&mut w.placement);
        let borrowed = w.borrowed.take();
        w.work_done_ms += now - w.started_at_ms;
        let leaving = w.preempting.take().is_some();
        if leaving {
            self.preempting.remove(&id);
        } else {
            self.contracts.remove(w);
        }
        for p in &parts {
            if let Some(b) = borrowed {
                if !leaving {
                    self.lent.remove(&(b.reserved_for, b.until_ms, p.node, id));
                }
            }
            let holds = u32::from(borrowed.is_some()) + u32::from(leaving);
            if holds > 0 {
                let n = self.leaving_nodes.get_mut(&p.node).expect("indexed");
                *n -= holds;
                if *n == 0 {
                    self.leaving_nodes.remove(&p.node);
                }
            }
        }
        let (alloc, gpus) = (w.allocation, w.gpus());
        let mut healthy_held = 0u64;
        for part in &parts {
            healthy_held +=
                u64::from((part.gpus & self.cluster.node(part.node).healthy).count_ones());
            self.cluster.update(part.node, |n| {
                n.used &= !part.gpus;
                n.tenants.retain(|t| t.workload != id);
            });
        }
        match alloc {
            Some(a) => self.allocations.node_mut(a).held_gpus -= gpus,
            None => self.unallocated_held_gpus -= gpus,
        }
        self.adjust_delivering(alloc, -(healthy_held as i64));
        self.running.remove(&id);
        self.running_with_estimate -= u64::from(self.workloads[&id].duration_estimate_ms.is_some());
    }

    pub(super) fn workload_stopped(
        &mut self,
        version: u16,
        e: &WorkloadStopped,
    ) -> Result<Outcome, Rejection> {
        let w = self.expect_phase(e.workload, Phase::Running)?;
        let hardware = e.reason == StopReason::HardwareFailure && self.holds_unhealthy_gpu(w);
        let early = self.now_ms < w.protected_until_ms;
        let violation = early
            && w.allocation.is_some()
            && matches!(
                e.reason,
                StopReason::Preempted | StopReason::HardwareFailure
            )
            && !hardware
            // (Borrowed GPUs taken back were asked for on the borrowing's term, as agreed.)
            && !matches!(
                w.preempting,
                Some(Preempting {
                    reason: PreemptionReason::UserCancelled
                        | PreemptionReason::HardwareFailure
                        | PreemptionReason::Reclaimed,
                    ..
                })
            );
        let alloc = w.allocation;
        let nodes: Vec<NodeIdx> = w.placement.iter().map(|p| p.node).collect();
        self.release(e.workload);
        if violation {
            self.counters.contract_violations += 1;
            if let Some(a) = alloc {
                self.allocations.node_mut(a).contract_violations += 1;
            }
        }
        if e.reason == StopReason::Cancelled {
            self.end(e.workload, Phase::Cancelled);
        } else {
            let w = self.workloads.get_mut(&e.workload).expect("checked");
            w.phase = Phase::Stopped;
            w.stopped_on = nodes;
            // A run that outlasted its estimate proved the estimate wrong: it is relied on no
            // more. Else work that never ends when it said would be lent a reservation's GPUs
            // again after every preemption, and the reservation's holder would never start.
            // (From schema version 2: a replay of an older log keeps the estimates it had.)
            if version >= 2 && w.duration_estimate_ms.is_some_and(|d| w.work_done_ms >= d) {
                w.duration_estimate_ms = None;
                w.estimate_outlasted = true;
            }
            let gpus = w.gpus() as i64;
            if let Some(a) = alloc {
                self.change_demand(a, -gpus);
            }
        }
        Ok(Outcome::Applied)
    }

    pub(super) fn workload_finished(&mut self, e: &WorkloadFinished) -> Result<Outcome, Rejection> {
        self.expect_phase(e.workload, Phase::Running)?;
        self.release(e.workload);
        self.end(e.workload, Phase::Finished);
        Ok(Outcome::Applied)
    }

    pub(super) fn workload_requeued(&mut self, e: &WorkloadRequeued) -> Result<Outcome, Rejection> {
        self.expect_phase(e.workload, Phase::Stopped)?;
        let w = self.workloads.get_mut(&e.workload).expect("checked");
        w.phase = Phase::Pending;
        w.stopped_on.clear();
        w.work_done_ms = w
            .work_done_ms
            .saturating_sub(e.work_lost_s.saturating_mul(1000));
        let w = w.clone();
        if let Some(a) = w.allocation {
            self.change_demand(a, w.gpus() as i64);
        }
        self.enqueue(&w);
        Ok(Outcome::Applied)
    }
}
