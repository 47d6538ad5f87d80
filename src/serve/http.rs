//! The HTTP/1.1 accept loop: axum's router served by hyper, with the limits a server
//! facing slow or hostile clients needs (axum's own `serve` sets no timer, so hyper's
//! header timeout never fires there):
//!
//! - a client must send a request's headers within the timeout (`--timeout`), an idle
//!   keep-alive connection is closed after it, and a body must arrive within it too
//!   (the handlers' [`super::api`] body reader);
//! - at most `--max-connections` connections are served at once; one more is answered
//!   503 at once and closed (as nginx's `limit_conn` does), so a flood of stalled
//!   connections cannot exhaust the process's file descriptors or leave new clients
//!   (a health check among them) hanging, and the timeout frees the held slots;
//! - on shutdown the listener closes and open connections finish gracefully.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// The answer to a connection past the limit: OpenAI's error JSON, then close.
fn refusal() -> Vec<u8> {
    let body = r#"{"error":{"message":"the server has too many open connections; retry later","type":"server_error","param":null,"code":503}}"#;
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         retry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Send [`refusal`], then read what the client sent until it closes (a second at most:
/// closing with unread bytes would reset the connection before the client reads the
/// answer), and close.
async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(&refusal()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<(), std::io::Error>(())
    })
    .await;
}

/// Refusals in progress at most; past it a connection is closed without an answer.
const MAX_REFUSING: usize = 64;

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
    let refusing = Arc::new(Semaphore::new(MAX_REFUSING));
    tokio::pin!(shutdown);
    loop {
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
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            tracing::warn!("{max_connections} connections are open: one more refused with 503");
            if let Ok(busy) = refusing.clone().try_acquire_owned() {
                tokio::spawn(async move {
                    refuse(stream).await;
                    drop(busy);
                });
            }
            continue;
        };
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
