//! What a connection may hold: a cap on open connections, a deadline for each request's
//! headers (which also closes idle keep-alive connections) and one for its body. A client that
//! connects and says nothing, dribbles its headers or never finishes its body is cut off, so
//! idle and slow sockets cannot use up the process's file descriptors.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::{Problem, MAX_BODY};

/// The limits of connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once; one more is closed as soon as it is accepted.
    pub max_connections: usize,
    /// A request's headers must arrive within this; a connection idle for this long between
    /// requests is closed.
    pub header_timeout: Duration,
    /// A request's body must arrive within this.
    pub body_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 4_096,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
        }
    }
}

/// File descriptors kept free of connections: the log, the projection, agents' runs.
const FDS_KEPT: u64 = 256;

impl Limits {
    /// These limits, with the connection cap lowered to what the process's file-descriptor
    /// limit allows once its soft limit is raised to the hard one.
    pub fn fitted(mut self) -> Self {
        use nix::sys::resource::{getrlimit, setrlimit, Resource};
        if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
            let soft = if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
                hard
            } else {
                soft
            };
            let room = soft.saturating_sub(FDS_KEPT).max(16) as usize;
            if room < self.max_connections {
                tracing::warn!(
                    "at most {room} connections at once: the file-descriptor limit is {soft} (raise it with ulimit -n)"
                );
                self.max_connections = room;
            }
        }
        self
    }
}

/// An acceptor that holds a permit for each open connection, closes those over the cap, and
/// closes a new connection that sends nothing within the header deadline (hyper's header
/// deadline covers a keep-alive connection between requests, but a new one only from its first
/// byte: measured, a silent new connection stayed open without this).
#[derive(Clone, Debug)]
pub struct Capped<A> {
    inner: A,
    permits: Arc<Semaphore>,
    first_byte: Duration,
}

impl<A> Capped<A> {
    /// `inner`, at most `limits.max_connections` at once.
    pub fn new(inner: A, limits: &Limits) -> Self {
        Capped {
            inner,
            permits: Arc::new(Semaphore::new(limits.max_connections)),
            first_byte: limits.header_timeout,
        }
    }
}

type Accepting<T> = Pin<Box<dyn Future<Output = io::Result<T>> + Send>>;

impl<I, S, A> axum_server::accept::Accept<I, S> for Capped<A>
where
    A: axum_server::accept::Accept<I, S>,
    A::Future: Send + 'static,
    A::Stream: Send + 'static,
    A::Service: Send + 'static,
{
    type Stream = Held<A::Stream>;
    type Service = A::Service;
    type Future = Accepting<(Self::Stream, Self::Service)>;

    fn accept(&self, stream: I, service: S) -> Self::Future {
        let Ok(permit) = self.permits.clone().try_acquire_owned() else {
            drop(stream);
            tracing::debug!("a connection over the cap was closed");
            return Box::pin(std::future::ready(Err(io::Error::other(
                "too many connections",
            ))));
        };
        let accepting = self.inner.accept(stream, service);
        let first_byte = self.first_byte;
        Box::pin(async move {
            let (stream, service) = accepting.await?;
            Ok((
                Held {
                    stream,
                    _permit: permit,
                    first_byte: Some(Box::pin(tokio::time::sleep(first_byte))),
                },
                service,
            ))
        })
    }
}

/// A connection's stream with the permit it holds until it closes, and the deadline of its
/// first byte until one arrives.
#[derive(Debug)]
pub struct Held<S> {
    stream: S,
    _permit: OwnedSemaphorePermit,
    first_byte: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Held<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                this.first_byte = None;
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                let late = this
                    .first_byte
                    .as_mut()
                    .is_some_and(|deadline| deadline.as_mut().poll(cx).is_ready());
                if late {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "no request within the header deadline",
                    )));
                }
                Poll::Pending
            }
            done => done,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Held<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// Reads a request's body whole, within `timeout` and [`MAX_BODY`], before any handler sees
/// it: a body that dribbles is answered 408 and does not hold the handler.
pub async fn body_within(timeout: Duration, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, MAX_BODY)).await {
        Err(_) => Problem::new(
            StatusCode::REQUEST_TIMEOUT,
            "body-timeout",
            format!(
                "the request body did not arrive within {} s; send it whole",
                timeout.as_secs()
            ),
        )
        .into_response(),
        Ok(Err(_)) => Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
            format!("the body is larger than {MAX_BODY} bytes, or was cut off"),
        )
        .into_response(),
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
    }
}
