//! Workloads: submission and its checks, the queues, who submitted, cancellation and the ends
//! of workloads.

use super::*;

impl State {
    pub(super) fn check_known(&self, id: WorkloadId) -> Result<(), Rejection> {
        if self.workloads.contains_key(&id) {
            return Ok(());
        }
        if let Some(phase) = self.ended_phase(id) {
            return Err(Rejection::WrongPhase {
                workload: id,
                phase: phase.name(),
                expected: "live",
            });
        }
        Err(Rejection::UnknownWorkload { workload: id })
    }

    pub(super) fn expect_phase(
        &self,
        id: WorkloadId,
        expected: Phase,
    ) -> Result<&Workload, Rejection> {
        self.check_known(id)?;
        let w = &self.workloads[&id];
        if w.phase != expected {
            return Err(Rejection::WrongPhase {
                workload: id,
                phase: w.phase.name(),
                expected: expected.name(),
            });
        }
        Ok(w)
    }

    /// Checks a submission from an event of `version`: `Err(Ok(original))` for a key used
    /// before, else its allocation and GPU model. What it runs is checked from version 2 on.
    #[allow(clippy::type_complexity)]
    pub(super) fn check_submitted(
        &self,
        version: u16,
        e: &WorkloadSubmitted,
        actor: &str,
    ) -> Result<Result<(Option<AllocId>, Option<u32>), WorkloadId>, Rejection> {
        if let Some(key) = &e.idempotency_key {
            if let Some(original) = self.idempotent(key) {
                return Ok(Err(original));
            }
        }
        if self.workloads.contains_key(&e.workload) || self.ended_phase(e.workload).is_some() {
            return Err(Rejection::DuplicateWorkload {
                workload: e.workload,
            });
        }
        if e.gpus_per_node == 0 {
            return Err(Rejection::MustBePositive {
                field: "gpus_per_node",
            });
        }
        if e.nodes == 0 {
            return Err(Rejection::MustBePositive { field: "nodes" });
        }
        let allocation = match &e.allocation {
            None => None,
            Some(path) => {
                let id = self.allocations.live(path)?;
                if !self.allocations.node(id).is_leaf() {
                    return Err(Rejection::AllocationNotLeaf { path: path.clone() });
                }
                Some(id)
            }
        };
        let model = match &e.model {
            None => None,
            Some(m) => Some(
                self.cluster
                    .model_idx(m)
                    .ok_or_else(|| Rejection::UnknownGpuModel { model: m.clone() })?,
            ),
        };
        let largest = self.cluster.largest_node(model);
        if e.gpus_per_node > largest {
            return Err(Rejection::GpusPerNodeExceedLargestNode {
                gpus_per_node: e.gpus_per_node,
                largest,
            });
        }
        let eligible = self.cluster.gang_capacity(model, e.gpus_per_node);
        if e.nodes > eligible {
            return Err(Rejection::GangLargerThanCluster {
                nodes: e.nodes,
                gpus_per_node: e.gpus_per_node,
                eligible,
            });
        }
        let cap_s = self.config.min_runtime_cap_ms / 1000;
        if let Some(m) = e.min_runtime_s {
            if m > cap_s {
                return Err(Rejection::MinRuntimeAboveCap {
                    min_runtime_s: m,
                    cap_s,
                });
            }
        }
        if version >= 2 {
            crate::names::workload(e.name.as_deref(), &e.command, &e.env)?;
        }
        if let Some(url) = &e.notify {
            crate::notify::check_url(&self.settings.notify_urls, "notify", url)?;
        }
        if version >= 4 {
            self.check_quotas(allocation, e.gpus_per_node as u64 * e.nodes as u64, actor)?;
        }
        Ok(Ok((allocation, model)))
    }

    /// Whether one more waiting workload of `gpus` GPUs, charged to `allocation` and submitted
    /// by `actor`, stays within the submitter's cap on waiting work
    /// ([`crate::identity::Principal::pending_cap`]) and within the `max_pending_workloads` and
    /// `max_pending_gpus` of its allocation and each ancestor (a quota bounds a whole subtree).
    fn check_quotas(
        &self,
        allocation: Option<AllocId>,
        gpus: u64,
        actor: &str,
    ) -> Result<(), Rejection> {
        let principal = self.principals.by_actor(actor);
        if let Some(cap) = principal.and_then(|p| p.pending_cap()) {
            let waiting = self
                .actor_ids
                .get(actor)
                .and_then(|id| self.pending_by_actor.get(id))
                .copied()
                .unwrap_or(0);
            if waiting >= cap {
                return Err(Rejection::QuotaExceeded {
                    holder: actor.to_owned(),
                    what: "workloads",
                    setting: "max_pending",
                    limit: cap.into(),
                    waiting: u64::from(waiting) + 1,
                });
            }
        }
        let mut at = allocation;
        while let Some(id) = at {
            let a = self.allocations.node(id);
            if a.max_pending_workloads.is_some() || a.max_pending_gpus.is_some() {
                let (workloads, waiting_gpus) = self.subtree_pending(id);
                if let Some(limit) = a.max_pending_workloads {
                    if workloads + 1 > u64::from(limit) {
                        return Err(Rejection::QuotaExceeded {
                            holder: a.path.clone(),
                            what: "workloads",
                            setting: "max_pending_workloads",
                            limit: limit.into(),
                            waiting: workloads + 1,
                        });
                    }
                }
                if let Some(limit) = a.max_pending_gpus {
                    if waiting_gpus + gpus > limit {
                        return Err(Rejection::QuotaExceeded {
                            holder: a.path.clone(),
                            what: "GPUs",
                            setting: "max_pending_gpus",
                            limit,
                            waiting: waiting_gpus + gpus,
                        });
                    }
                }
            }
            at = a.parent;
        }
        Ok(())
    }

    /// Workloads waiting in the subtree of `id`, and the GPUs they ask for.
    pub fn subtree_pending(&self, id: AllocId) -> (u64, u64) {
        let a = self.allocations.node(id);
        if a.is_leaf() {
            let n = self.queues.get(&id).map_or(0, |q| q.len() as u64);
            return (n, self.pending_gpus.get(&id).copied().unwrap_or(0));
        }
        a.children.iter().fold((0, 0), |(n, g), &c| {
            let (cn, cg) = self.subtree_pending(c);
            (n + cn, g + cg)
        })
    }

    pub(super) fn workload_submitted(
        &mut self,
        seq: u64,
        version: u16,
        e: &WorkloadSubmitted,
        actor: &str,
    ) -> Result<Outcome, Rejection> {
        let (allocation, model) = match self.check_submitted(version, e, actor)? {
            Ok(checked) => checked,
            Err(original) => return Ok(Outcome::Duplicate { original }),
        };
        let w = Workload {
            id: e.workload,
            allocation,
            gpus_per_node: e.gpus_per_node,
            nodes: e.nodes,
            model,
            priority: e.priority,
            min_runtime_ms: e.min_runtime_s.map(|s| s * 1000),
            duration_estimate_ms: e.duration_estimate_s.map(|s| s.saturating_mul(1000)),
            estimate_outlasted: false,
            checkpoint_ms: e.checkpoint_s.map(|s| s.saturating_mul(1000)),
            submitted_at_ms: self.now_ms,
            submit_seq: seq,
            phase: Phase::Pending,
            placement: Vec::new(),
            started_at_ms: 0,
            protected_until_ms: 0,
            preempting: None,
            borrowed: None,
            work_done_ms: 0,
            starts: 0,
            preemptions: 0,
            submitted_by: self.actor_id(actor),
            stopped_on: Vec::new(),
        };
        if let Some(key) = &e.idempotency_key {
            self.idempotency.insert(key.clone(), e.workload);
        }
        if let Some(a) = allocation {
            self.allocations.node_mut(a).live_workloads += 1;
            self.change_demand(a, w.gpus() as i64);
        }
        self.enqueue(&w);
        self.workloads.insert(e.workload, w);
        Ok(Outcome::Applied)
    }

    pub(super) fn actor_id(&mut self, actor: &str) -> u32 {
        if let Some(&id) = self.actor_ids.get(actor) {
            return id;
        }
        let id = self.actors.len() as u32;
        self.actors.push(actor.to_owned());
        self.actor_ids.insert(actor.to_owned(), id);
        id
    }

    // ---- principals --------------------------------------------------------------------------

    pub(super) fn principal_granted(
        &mut self,
        seq: u64,
        e: &PrincipalGranted,
        actor: &str,
    ) -> Result<Outcome, Rejection> {
        self.check_granted(e, actor)?;
        self.principals.grant(e, actor, self.now_ms, seq);
        Ok(Outcome::Applied)
    }

    /// Whether grant `e` by `actor` may be folded: the principals' rules, a default URL for
    /// notifications the settings allow, and the root's grant being its holder's own (the
    /// first grant of the role `service` is the log's root of authority, [`crate::authority`]).
    pub fn check_granted(&self, e: &PrincipalGranted, actor: &str) -> Result<(), Rejection> {
        self.principals.check_grant(e, &self.allocations)?;
        if e.role == crate::identity::Role::Service
            && self.principals.root().is_none()
            && actor != e.name
        {
            return Err(Rejection::Unauthorized {
                actor: actor.to_owned(),
                kind: "principal_granted",
                reason: format!(
                    "the first grant of the role service is the log's root of authority, which its holder writes for itself: actor {:?}",
                    e.name
                ),
            });
        }
        if let Some(url) = &e.notify {
            crate::notify::check_url(&self.settings.notify_urls, "notify", url)?;
        }
        Ok(())
    }

    /// The key of `w` in its queue.
    pub fn queue_key(w: &Workload) -> QueueKey {
        (std::cmp::Reverse(w.priority), w.submit_seq, w.id)
    }

    pub(super) fn enqueue(&mut self, w: &Workload) {
        *self
            .pending_shapes
            .entry((w.gpus_per_node, w.nodes))
            .or_insert(0) += 1;
        self.pending_with_estimate += u64::from(w.duration_estimate_ms.is_some());
        *self.pending_by_actor.entry(w.submitted_by).or_insert(0) += 1;
        let key = Self::queue_key(w);
        match w.allocation {
            Some(a) => {
                *self.pending_gpus.entry(a).or_insert(0) += w.gpus();
                self.queues.entry(a).or_default().insert(key);
                self.queue_shapes
                    .entry(a)
                    .or_default()
                    .entry((w.gpus_per_node, w.nodes))
                    .or_default()
                    .insert(key);
            }
            None => {
                self.unallocated_queue.insert(key);
            }
        }
    }

    pub(super) fn dequeue(&mut self, id: WorkloadId) {
        let w = &self.workloads[&id];
        self.pending_with_estimate -= u64::from(w.duration_estimate_ms.is_some());
        if let Some(n) = self.pending_by_actor.get_mut(&w.submitted_by) {
            *n -= 1;
            if *n == 0 {
                self.pending_by_actor.remove(&w.submitted_by);
            }
        }
        if let Some(a) = w.allocation {
            if let Some(g) = self.pending_gpus.get_mut(&a) {
                *g -= w.gpus();
                if *g == 0 {
                    self.pending_gpus.remove(&a);
                }
            }
        }
        let shape = (w.gpus_per_node, w.nodes);
        if let Some(n) = self.pending_shapes.get_mut(&shape) {
            *n -= 1;
            if *n == 0 {
                self.pending_shapes.remove(&shape);
            }
        }
        let key = Self::queue_key(w);
        match w.allocation {
            Some(a) => {
                if let Some(q) = self.queues.get_mut(&a) {
                    q.remove(&key);
                    if q.is_empty() {
                        self.queues.remove(&a);
                    }
                }
                if let Some(shapes) = self.queue_shapes.get_mut(&a) {
                    if let Some(keys) = shapes.get_mut(&shape) {
                        keys.remove(&key);
                        if keys.is_empty() {
                            shapes.remove(&shape);
                        }
                    }
                    if shapes.is_empty() {
                        self.queue_shapes.remove(&a);
                    }
                }
            }
            None => {
                self.unallocated_queue.remove(&key);
            }
        }
    }

    /// Moves a workload to a terminal phase, releasing its demand.
    pub(super) fn end(&mut self, id: WorkloadId, phase: Phase) {
        let w = self
            .workloads
            .remove(&id)
            .expect("caller checked the workload");
        debug_assert!(w.placement.is_empty());
        if let Some(a) = w.allocation {
            self.allocations.node_mut(a).live_workloads -= 1;
            if w.phase != Phase::Stopped {
                self.change_demand(a, -(w.gpus() as i64));
            }
        }
        self.ended.insert(id, phase);
    }

    /// Moves the ledger's sequence past `seq`, an event that could not be read at all (it is
    /// recorded elsewhere as malformed): the state does not change.
    pub fn skip(&mut self, seq: u64) {
        self.last_seq = self.last_seq.max(seq);
    }

    /// How many distinct actors the ledger has seen.
    pub fn actor_count(&self) -> usize {
        self.actors.len()
    }

    /// GPUs unallocated work is being delivered now (held on healthy GPUs).
    pub fn unallocated_delivering_gpus(&self) -> u64 {
        self.unallocated_delivering_gpus
    }

    /// Workloads waiting in the queue of leaf `leaf`.
    pub fn queued_in(&self, leaf: AllocId) -> usize {
        self.queues.get(&leaf).map_or(0, BTreeSet::len)
    }

    /// What cancelling workload `id` writes now: a pending or stopped workload is cancelled
    /// outright; a running one is asked to stop (a preemption for its owner, with `grace_ms` to
    /// checkpoint) and ends as cancelled when its agent reports the stop. One already being
    /// stopped, or ended, cannot be cancelled.
    pub fn cancellation(
        &self,
        id: WorkloadId,
        grace_ms: u64,
        reason: Option<String>,
    ) -> Result<Event, Rejection> {
        self.check_known(id)?;
        let w = &self.workloads[&id];
        match w.phase {
            Phase::Running if w.preempting.is_some() => {
                Err(Rejection::AlreadyPreempting { workload: id })
            }
            Phase::Running => Ok(Event::PreemptionRequested(PreemptionRequested {
                workload: id,
                reason: PreemptionReason::UserCancelled,
                beneficiary: None,
                grace_s: grace_ms / 1000,
            })),
            _ => Ok(Event::WorkloadCancelled(WorkloadCancelled {
                workload: id,
                reason,
            })),
        }
    }

    /// Checks a cancel: the workload's phase, pending or stopped.
    pub(super) fn check_cancelled(&self, e: &WorkloadCancelled) -> Result<Phase, Rejection> {
        self.check_known(e.workload)?;
        match self.workloads[&e.workload].phase {
            phase @ (Phase::Pending | Phase::Stopped) => Ok(phase),
            phase => Err(Rejection::WrongPhase {
                workload: e.workload,
                phase: phase.name(),
                expected: "pending or stopped (preempt a running workload first)",
            }),
        }
    }

    pub(super) fn workload_cancelled(
        &mut self,
        e: &WorkloadCancelled,
    ) -> Result<Outcome, Rejection> {
        if self.check_cancelled(e)? == Phase::Pending {
            self.dequeue(e.workload);
        }
        self.end(e.workload, Phase::Cancelled);
        Ok(Outcome::Applied)
    }
}
