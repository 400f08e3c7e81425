//! `kiln serve`: a trained model behind HTTP.
//!
//! Routes: `POST /translate` (JSON in and out, [`api`]), `GET /health`, `GET /model`
//! (what is loaded). Requests that arrive together are translated together
//! ([`batcher`]); a bad request gets a 4xx status and a JSON message and the server goes
//! on; SIGTERM or Ctrl-C stops taking connections and lets the requests in flight finish;
//! a connection that sends no headers within `--header-timeout-ms` is closed, and a body
//! that does not arrive within `--body-timeout-ms` is answered 408. The routes are axum's,
//! the connections hyper's HTTP/1 on tokio; the translation runs on kiln's own threads.

pub(crate) mod api;
pub(crate) mod batcher;

use std::net::SocketAddr;
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use kiln::translator::Translator;
use kiln_dsl::Error;
use serde_json::Value;
use tokio::sync::oneshot;

use crate::args::SearchArgs;
use crate::plain;
use api::{ApiError, Limits};
use batcher::{Gather, Job};

/// How the server listens, what it allows and how it batches.
pub(crate) struct Settings {
    pub host: String,
    pub port: u16,
    /// The search a request gets unless it says otherwise.
    pub defaults: SearchArgs,
    pub limits: Limits,
    pub gather: Gather,
    /// Requests waiting for the batcher beyond which new ones are turned away (503).
    pub queue: usize,
    /// What `GET /model` answers.
    pub model: Value,
    /// A connection that has not sent a request's headers within this long is closed.
    pub header_timeout: Duration,
    /// A request whose body has not arrived within this long is answered 408.
    pub body_timeout: Duration,
}

struct App {
    translator: Arc<Translator>,
    jobs: SyncSender<Job>,
    defaults: SearchArgs,
    limits: Limits,
    model: Value,
    body_timeout: Duration,
}

fn json(status: StatusCode, body: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn refuse(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    let mut r = json(status, &e.body());
    if e.status == 503 {
        r.headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    }
    r
}

/// Serves `translator` until SIGTERM or Ctrl-C; the requests in flight finish first.
pub(crate) fn serve(translator: Translator, settings: Settings) -> Result<(), Error> {
    let translator = Arc::new(translator);
    let (jobs, queue) = sync_channel::<Job>(settings.queue);
    let batcher = {
        let (t, gather) = (Arc::clone(&translator), settings.gather);
        std::thread::Builder::new()
            .name("kiln-batcher".to_string())
            .spawn(move || batcher::run(t, queue, gather))
            .map_err(|e| {
                plain(
                    "kiln::serve",
                    format!("cannot start the batcher: {e}"),
                    None,
                )
            })?
    };
    let app = Arc::new(App {
        translator,
        jobs,
        defaults: settings.defaults,
        limits: settings.limits,
        model: settings.model,
        body_timeout: settings.body_timeout,
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| {
            plain(
                "kiln::serve",
                format!("cannot start the runtime: {e}"),
                None,
            )
        })?;
    let address = (settings.host.as_str(), settings.port);
    let served = runtime.block_on(listen(app, address, settings.header_timeout));
    // The handlers are done and their senders gone: the batcher answers what it holds
    // and stops.
    drop(runtime);
    let _ = batcher.join();
    served
}

async fn listen(
    app: Arc<App>,
    (host, port): (&str, u16),
    header_timeout: Duration,
) -> Result<(), Error> {
    let listener = tokio::net::TcpListener::bind((host, port))
        .await
        .map_err(|e| {
            plain(
                "kiln::serve",
                format!("cannot listen on {host}:{port}: {e}"),
                Some("choose another --port (0 picks a free one) or --host".to_string()),
            )
        })?;
    let addr: SocketAddr = listener
        .local_addr()
        .map_err(|e| plain("kiln::serve", e.to_string(), None))?;
    let router = Router::new()
        .route("/translate", post(translate))
        .route("/health", get(health))
        .route("/model", get(model))
        .fallback(not_found)
        .method_not_allowed_fallback(wrong_method)
        .with_state(app);

    // The address on one line of its own, for scripts and tests to read.
    eprintln!("kiln serve: listening on http://{addr}");
    // hyper's HTTP/1 with a timer, so that a client that sends no request, or only part
    // of its headers, loses its connection after `header_timeout` (axum::serve has no
    // such setting); the connections are watched for a graceful shutdown.
    let graceful = GracefulShutdown::new();
    let mut stop = std::pin::pin!(stop_signal());
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                // A failed accept (out of file descriptors) drops that connection only.
                let Ok((stream, _)) = accepted else { continue };
                let service = TowerToHyperService::new(router.clone());
                let conn = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(header_timeout)
                    .serve_connection(TokioIo::new(stream), service);
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    // A connection's own error (reset, timeout) ends that connection only.
                    let _ = conn.await;
                });
            }
            () = &mut stop => break,
        }
    }
    drop(listener);
    graceful.shutdown().await;
    eprintln!("kiln serve: stopped");
    Ok(())
}

/// SIGTERM or Ctrl-C.
async fn stop_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    eprintln!("kiln serve: stopping; the requests in flight finish first");
}

async fn health() -> Response {
    json(StatusCode::OK, &serde_json::json!({"status": "ok"}))
}

async fn model(State(app): State<Arc<App>>) -> Response {
    json(StatusCode::OK, &app.model)
}

async fn not_found() -> Response {
    refuse(&ApiError::new(
        404,
        "no such route: use POST /translate, GET /health or GET /model",
    ))
}

async fn wrong_method() -> Response {
    refuse(&ApiError::new(
        405,
        "wrong method: /translate takes POST; /health and /model take GET",
    ))
}

async fn translate(State(app): State<Arc<App>>, body: Body) -> Response {
    match translate_body(&app, body).await {
        Ok(v) => json(StatusCode::OK, &v),
        Err(e) => refuse(&e),
    }
}

async fn translate_body(app: &App, body: Body) -> Result<Value, ApiError> {
    let max = app.limits.body_bytes;
    let read = tokio::time::timeout(app.body_timeout, axum::body::to_bytes(body, max));
    let bytes = read
        .await
        .map_err(|_| {
            ApiError::new(
                408,
                format!(
                    "the request body did not arrive within {} ms (--body-timeout-ms)",
                    app.body_timeout.as_millis()
                ),
            )
        })?
        .map_err(|_| {
            ApiError::new(
                413,
                format!("the request body is over {max} bytes (--max-body-bytes): split it"),
            )
        })?;
    let req = api::parse_translate(&bytes, &app.defaults, &app.limits)?;
    let name = |i: usize| format!("sentence {}", i + 1);
    let src = app
        .translator
        .encode_lines(&req.text, &name)
        .map_err(|e| ApiError::new(422, api::api_message(&e)))?;
    let mut per_line = vec![Vec::new(); src.lines];
    if !src.ids.is_empty() {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            ids: src.ids,
            opts: req.opts,
            nbest: req.nbest,
            reply,
        };
        app.jobs.try_send(job).map_err(|e| match e {
            TrySendError::Full(_) => ApiError::new(
                503,
                "busy: too many requests are waiting (--queue); retry in a moment",
            ),
            TrySendError::Disconnected(_) => ApiError::new(503, "the server is stopping"),
        })?;
        let hyps = answer
            .await
            .map_err(|_| ApiError::new(500, "internal error: the batch was dropped"))?
            .map_err(|why| ApiError::new(500, why))?;
        for (&i, h) in src.which.iter().zip(hyps) {
            per_line[i] = h;
        }
    }
    Ok(api::translations(
        &app.translator.tokenizer,
        &per_line,
        req.nbest,
    ))
}
