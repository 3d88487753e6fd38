//! Following the ledger without a consumer: for processes whose NATS users may not make one
//! (agents, readers), the `LEDGER` stream's feed — every event published again as stored, with
//! its sequence — with what it misses read back by direct gets.

use std::time::Duration;

use futures::stream::BoxStream;
use futures::StreamExt;

use super::{msg_id_in, JetStreamLog};
use crate::{EventLog, LogError, Stored};

/// How long a follower of the feed waits for its next event before asking the stream whether
/// it missed some (a dropped message shows only when the next one comes, or at this check).
const FEED_QUIET: Duration = Duration::from_secs(2);

/// Events a follower of the feed reads from the stream at once to catch up.
const FEED_CATCH_UP: usize = 500;

impl JetStreamLog {
    /// A subscription from `from` that makes no consumer: the events up to now read by direct
    /// gets, then the stream's feed (its events published again as stored, each with its
    /// sequence), any gap in it (a message dropped, a reconnection) filled by direct gets, and
    /// the stream asked after [`FEED_QUIET`] without news. What agents and readers, who may not
    /// touch the ledger's consumers, follow.
    pub(super) async fn follow_feed(
        &self,
        from: u64,
    ) -> Result<BoxStream<'static, Result<Stored, LogError>>, LogError> {
        // Subscribed before reading, so that nothing stored meanwhile is missed.
        let feed = self
            .client
            .subscribe(format!("{}.>", crate::subject::FEED_PREFIX))
            .await
            .map_err(|e| LogError::Unavailable(format!("following the ledger: {e}")))?;
        struct Follower {
            log: JetStreamLog,
            feed: async_nats::Subscriber,
            next: u64,
            backlog: std::collections::VecDeque<Stored>,
            behind: bool,
            failed: bool,
        }
        let follower = Follower {
            log: self.clone(),
            feed,
            next: from.max(1),
            backlog: Default::default(),
            behind: true,
            failed: false,
        };
        Ok(futures::stream::unfold(follower, |mut f| async move {
            if f.failed {
                return None;
            }
            loop {
                while let Some(e) = f.backlog.pop_front() {
                    if e.seq == f.next {
                        f.next += 1;
                        return Some((Ok(e), f));
                    }
                }
                if f.behind {
                    match f.log.read(f.next, FEED_CATCH_UP).await {
                        Ok(page) if page.is_empty() => f.behind = false,
                        Ok(page) => f.backlog.extend(page),
                        Err(e) => {
                            f.failed = true;
                            return Some((Err(e), f));
                        }
                    }
                    continue;
                }
                match tokio::time::timeout(FEED_QUIET, f.feed.next()).await {
                    Ok(Some(message)) => match fed(&message) {
                        Some(e) if e.seq == f.next => f.backlog.push_back(e),
                        Some(e) if e.seq < f.next => {}
                        // A gap (or a message without its sequence): read from the stream.
                        _ => f.behind = true,
                    },
                    Ok(None) => {
                        f.failed = true;
                        let ended = LogError::Unavailable("the ledger's feed ended".into());
                        return Some((Err(ended), f));
                    }
                    Err(_) => f.behind = true,
                }
            }
        })
        .boxed())
    }
}

/// An event as the ledger's feed carries it: its sequence and original subject in the headers
/// the stream adds when it publishes it again.
fn fed(message: &async_nats::Message) -> Option<Stored> {
    let headers = message.headers.as_ref()?;
    let seq = headers.get("Nats-Sequence")?.as_str().parse().ok()?;
    let subject = headers.get("Nats-Subject")?.as_str().to_owned();
    Some(Stored {
        seq,
        subject,
        msg_id: msg_id_in(message.headers.as_ref()),
        payload: message.payload.clone(),
    })
}
