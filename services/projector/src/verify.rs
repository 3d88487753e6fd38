//! `audit verify`: refolds the log from its first event, apart from the projection, and
//! compares every kept row with the row the refold closes. This is how an outside auditor
//! checks that the figures the service shows are the ones the events imply.

use std::collections::BTreeMap;

use eventlog::EventLog;
use ledger::book::{Book, Granularity, Row};
use ledger::chain::Head;
use ledger::state::{State, StateConfig};

use crate::{kept_key, Kept, ProjectionError};

/// Which rows to compare.
#[derive(Clone, Debug, Default)]
pub struct Scope {
    /// Only periods starting at or after this time.
    pub from_ms: Option<u64>,
    /// Only periods starting before this time.
    pub to_ms: Option<u64>,
    /// Only this allocation and those below it (and then no cluster rows).
    pub allocation: Option<String>,
}

impl Scope {
    fn holds(&self, row: &Row) -> bool {
        let t = row.from_ms();
        if self.from_ms.is_some_and(|f| t < f) || self.to_ms.is_some_and(|to| t >= to) {
            return false;
        }
        match (&self.allocation, row) {
            (None, _) => true,
            (Some(a), Row::Allocation(r)) => {
                r.path == *a
                    || r.path
                        .strip_prefix(a.as_str())
                        .is_some_and(|rest| rest.starts_with('/'))
            }
            (Some(_), Row::Cluster(_)) => false,
        }
    }
}

/// A kept row and what the refold says it should be; `None` on the side that lacks it.
#[derive(Clone, Debug, PartialEq)]
pub struct Difference {
    /// What the projection holds.
    pub kept: Option<Row>,
    /// What the events imply.
    pub refold: Option<Row>,
}

/// What a verification found.
#[derive(Clone, Debug, PartialEq)]
pub struct Verification {
    /// The refold went to this sequence.
    pub last_seq: u64,
    /// Rows compared (in scope, closed by then).
    pub compared: u64,
    /// Rows that differ.
    pub differences: Vec<Difference>,
    /// Where the refold's authority started: the root's name and the sequence of its grant;
    /// `None` for a log without a root (its events folded as their writers' claims).
    pub root: Option<(String, u64)>,
    /// Events the refold rejected because their actors lacked the authority they needed.
    pub unauthorized: u64,
}

/// The rows of every period still open in `book`, read at `state`'s clock (its last event):
/// the periods under way, as an audit shows them.
pub fn open_rows_now(book: &Book, state: &State) -> Vec<Row> {
    Granularity::ALL
        .iter()
        .flat_map(|&g| book.open_rows(state, g, 0, state.now_ms()))
        .collect()
}

/// Refolds `log` up to `up_to` and compares the rows it closes, in `scope`, with `kept`'s, and
/// the periods still open at `up_to`'s clock with `open` (the projection's, read at the same
/// sequence by [`open_rows_now`]): the hour under way is verified too. Kept rows of periods
/// the refold has not closed yet (the projection may have moved on) are not compared.
pub async fn verify<L: EventLog>(
    log: &L,
    kept: &Kept,
    open: &[Row],
    config: StateConfig,
    up_to: u64,
    scope: &Scope,
) -> Result<Verification, ProjectionError> {
    let mut state = State::new(config);
    let mut book = Book::new();
    let mut refold: BTreeMap<[u8; 15], Row> = BTreeMap::new();
    let mut next = 1;
    while next <= up_to {
        let events = log.read(next, 10_000).await?;
        let Some(end) = events.last().map(|e| e.seq) else {
            break;
        };
        crate::refold(&mut state, &mut book, &events, up_to);
        for row in book.take_closed().into_iter().filter(|r| scope.holds(r)) {
            refold.insert(kept_key(&row), row);
        }
        next = end + 1;
    }
    let mut compared = 0;
    let mut differences = Vec::new();
    for g in Granularity::ALL {
        let from = scope.from_ms.unwrap_or(0);
        let to = scope.to_ms.unwrap_or(u64::MAX).min(book.open_from(g));
        for row in kept
            .rows(g, from, to)?
            .into_iter()
            .filter(|r| scope.holds(r))
        {
            compared += 1;
            match refold.remove(&kept_key(&row)) {
                Some(r) if r == row => {}
                other => differences.push(Difference {
                    kept: Some(row),
                    refold: other,
                }),
            }
        }
    }
    for (_, row) in refold {
        compared += 1;
        differences.push(Difference {
            kept: None,
            refold: Some(row),
        });
    }
    // The periods under way, read at the last event folded on both sides.
    let mut refold_open: BTreeMap<[u8; 15], Row> = open_rows_now(&book, &state)
        .into_iter()
        .filter(|r| scope.holds(r))
        .map(|r| (kept_key(&r), r))
        .collect();
    for row in open.iter().filter(|r| scope.holds(r)) {
        compared += 1;
        match refold_open.remove(&kept_key(row)) {
            Some(r) if r == *row => {}
            other => differences.push(Difference {
                kept: Some(row.clone()),
                refold: other,
            }),
        }
    }
    for (_, row) in refold_open {
        compared += 1;
        differences.push(Difference {
            kept: None,
            refold: Some(row),
        });
    }
    let principals = state.principals();
    let root = principals
        .root()
        .zip(principals.root_seq())
        .map(|(name, seq)| (name.to_owned(), seq));
    Ok(Verification {
        last_seq: up_to,
        compared,
        differences,
        root,
        unauthorized: state.rejections().get("unauthorized").copied().unwrap_or(0),
    })
}

/// The log's head after the event at `seq` (see [`ledger::chain`]), chained from its first
/// event; `None` when the log ends before `seq`.
pub async fn head_at<L: EventLog>(log: &L, seq: u64) -> Result<Option<Head>, ProjectionError> {
    let mut head = Head::default();
    while head.seq < seq {
        let max = (seq - head.seq).min(10_000) as usize;
        let events = log.read(head.seq + 1, max).await?;
        if events.is_empty() {
            return Ok(None);
        }
        for e in events.iter().take_while(|e| e.seq <= seq) {
            if e.seq != head.seq + 1 {
                return Err(ProjectionError::Gap {
                    expected: head.seq + 1,
                    got: e.seq,
                });
            }
            head = head.next(e.seq, &e.payload);
        }
    }
    Ok(Some(head))
}
