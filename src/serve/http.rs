//! The HTTP/1.1 accept loop: axum's router served by hyper, with the limits a server
//! facing slow or hostile clients needs (axum's own `serve` sets no timer, so hyper's
//! header timeout never fires there):
//!
//! - a client must send a request's headers within the timeout (`--timeout`), an idle
//!   keep-alive connection is closed after it, and a body must arrive within it too
//!   (the handlers' [`super::api`] body reader);
//! - at most `--max-connections` connections are served at once; more wait in the
//!   kernel's accept queue until one closes, so a flood of stalled connections cannot
//!   exhaust the process's file descriptors, and the timeout frees their slots;
//! - on shutdown the listener closes and open connections finish gracefully.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// Serve `app` on `listener` until `shutdown` completes, then wait for the open
/// connections to end.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()>,
    timeout: Duration,
    max_connections: usize,
) {
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(max_connections.max(1)));
    tokio::pin!(shutdown);
    loop {
        // A free slot first: past the limit, connections wait in the accept queue.
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break, // never closed
            },
            _ = &mut shutdown => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: back off, keep serving.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(timeout)
            .serve_connection(TokioIo::new(stream), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!("connection ended: {e}");
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}
