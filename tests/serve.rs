//! `kiln serve` end to end: concurrent requests batched together answer what `kiln
//! translate` prints; a catalog of bad requests gets 4xx JSON and the server goes on;
//! SIGTERM lets a request in flight finish.

mod train_common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};
use train_common::{ok, workspace};

/// A workspace with an artifact of the tiny model's first weights and its tokenizer:
/// untrained, its translations are long and differ from sentence to sentence, so
/// nothing can agree by accident.
fn artifact(name: &str) -> PathBuf {
    let dir = workspace(name, "");
    ok(&dir, &["compile", "--config", "cfg.yaml", "-o", "art"]);
    dir
}

/// A running `kiln serve` and its address.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(dir: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(["serve", "--model", "art", "--port", "0", "--threads", "2"])
            .args(extra)
            .current_dir(dir)
            .env("NO_COLOR", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kiln serve starts");
        let stderr = child.stderr.take().unwrap();
        let mut lines = BufReader::new(stderr).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("kiln serve says where it listens")
                .unwrap();
            if let Some(a) = line.strip_prefix("kiln serve: listening on http://") {
                break a.to_string();
            }
        };
        // The rest of its standard error, read so that it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Server { child, addr }
    }

    /// `method path` with `body`: the status and the body parsed as JSON.
    fn call(&self, method: &str, path: &str, body: &[u8]) -> (u16, Value) {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            self.addr,
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body).unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP answer");
        let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: application/json"),
            "{head}"
        );
        (status, serde_json::from_str(body).expect("a JSON body"))
    }

    fn translate(&self, request: &Value) -> (u16, Value) {
        self.call("POST", "/translate", request.to_string().as_bytes())
    }

    fn stop(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        self.child.wait().unwrap()
    }
}

fn texts(answer: &Value) -> Vec<String> {
    answer["translations"]
        .as_array()
        .unwrap_or_else(|| panic!("{answer}"))
        .iter()
        .map(|t| t["text"].as_str().unwrap().to_string())
        .collect()
}

/// 8 clients send 12 requests each of 1 to 3 sentences, half of them greedy, all at
/// once: every answer is `kiln translate`'s line for line, whatever the batches.
#[test]
fn concurrent_requests_answer_what_kiln_translate_prints() {
    let dir = artifact("serve_concurrent");
    let lines: Vec<String> = std::fs::read_to_string(dir.join("valid.src"))
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    let beam = ok(
        &dir,
        &["translate", "--model", "art", "--input", "valid.src"],
    );
    let greedy = ok(
        &dir,
        &[
            "translate",
            "--model",
            "art",
            "--input",
            "valid.src",
            "--greedy",
        ],
    );
    let want = |greedy_search: bool| -> Vec<String> {
        let out = if greedy_search { &greedy } else { &beam };
        out.lines().map(str::to_string).collect()
    };
    let (beam_want, greedy_want) = (want(false), want(true));
    assert_ne!(beam_want, greedy_want, "the two searches differ here");
    let server = Server::start(&dir, &["--max-wait-ms", "30"]);
    std::thread::scope(|s| {
        for client in 0..8 {
            let (server, lines) = (&server, &lines);
            let (beam_want, greedy_want) = (&beam_want, &greedy_want);
            s.spawn(move || {
                for r in 0..12 {
                    let first = (client * 5 + r * 3) % lines.len();
                    let n = 1 + (client + r) % 3;
                    let which: Vec<usize> = (first..first + n).map(|i| i % lines.len()).collect();
                    let text: Vec<&str> = which.iter().map(|&i| lines[i].as_str()).collect();
                    let greedy = r % 2 == 1;
                    let (status, answer) =
                        server.translate(&json!({"text": text, "greedy": greedy}));
                    assert_eq!(status, 200, "{answer}");
                    let want = if greedy { greedy_want } else { beam_want };
                    let expected: Vec<String> = which.iter().map(|&i| want[i].clone()).collect();
                    assert_eq!(texts(&answer), expected, "client {client} request {r}");
                }
            });
        }
    });
    // The n-best list is the search's: its first is the translation, scores fall.
    let (status, answer) = server.translate(&json!({"text": [lines[0]], "nbest": 3}));
    assert_eq!(status, 200, "{answer}");
    let t = &answer["translations"][0];
    assert_eq!(t["text"].as_str().unwrap(), beam_want[0]);
    let nbest = t["nbest"].as_array().unwrap();
    assert_eq!(nbest.len(), 3);
    let scores: Vec<f64> = nbest.iter().map(|h| h["score"].as_f64().unwrap()).collect();
    assert!(scores.windows(2).all(|w| w[0] >= w[1]), "{scores:?}");
    assert_eq!(nbest[0]["text"], t["text"]);
    let tokens = t["tokens"].as_array().unwrap();
    assert_eq!(
        tokens.len(),
        beam_want[0].split(' ').count(),
        "one piece per word of this vocabulary: {t}"
    );
    assert!(server.stop().success());
}

/// Each bad request gets its 4xx status and a JSON message, and the server answers the
/// next request as if nothing had happened.
#[test]
fn bad_requests_get_4xx_json_and_the_server_goes_on() {
    let dir = artifact("serve_bad_requests");
    let server = Server::start(
        &dir,
        &[
            "--max-sentences",
            "8",
            "--max-chars",
            "1000",
            "--max-body-bytes",
            "200000",
        ],
    );
    let long_line = "s1 ".repeat(40_000);
    let huge = format!(r#"{{"text": ["{}"]}}"#, "s1 ".repeat(100_000));
    let catalog: Vec<(&str, &str, Vec<u8>, u16, &str)> = vec![
        (
            "POST",
            "/translate",
            b"{\"text\": [\"s1".to_vec(),
            400,
            "malformed JSON",
        ),
        (
            "POST",
            "/translate",
            b"\xff\xfe".to_vec(),
            400,
            "malformed JSON",
        ),
        (
            "POST",
            "/translate",
            b"[\"s1\"]".to_vec(),
            422,
            "not an object",
        ),
        (
            "POST",
            "/translate",
            b"{}".to_vec(),
            422,
            "missing field `text`",
        ),
        (
            "POST",
            "/translate",
            b"{\"text\": []}".to_vec(),
            422,
            "`text` is empty",
        ),
        (
            "POST",
            "/translate",
            b"{\"text\": \"s1\"}".to_vec(),
            422,
            "expected a sequence",
        ),
        (
            "POST",
            "/translate",
            b"{\"text\": [\"s1\"], \"beem\": 2}".to_vec(),
            422,
            "unknown field `beem`",
        ),
        (
            "POST",
            "/translate",
            b"{\"text\": [\"s1\"], \"beam\": 100000}".to_vec(),
            422,
            "`beam` is 100000",
        ),
        (
            "POST",
            "/translate",
            json!({"text": vec!["s1"; 9]}).to_string().into_bytes(),
            413,
            "at most 8 per request",
        ),
        (
            "POST",
            "/translate",
            json!({"text": [long_line]}).to_string().into_bytes(),
            413,
            "at most 1000 (--max-chars)",
        ),
        (
            "POST",
            "/translate",
            huge.into_bytes(),
            413,
            "over 200000 bytes",
        ),
        (
            "GET",
            "/translate",
            Vec::new(),
            405,
            "/translate takes POST",
        ),
        ("GET", "/nowhere", Vec::new(), 404, "no such route"),
    ];
    for (method, path, body, status, want) in &catalog {
        let (got, answer) = server.call(method, path, body);
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(got, *status, "{method} {path}: {answer}");
        assert_eq!(answer["error"]["status"], json!(status));
        assert!(message.contains(want), "{method} {path}: {message}");
        let (ok_status, fine) = server.translate(&json!({"text": ["s1 s2"]}));
        assert_eq!(ok_status, 200, "after {method} {path}: {fine}");
    }
    let (status, health) = server.call("GET", "/health", b"");
    assert_eq!((status, health), (200, json!({"status": "ok"})));
    let (status, model) = server.call("GET", "/model", b"");
    assert_eq!(status, 200);
    assert_eq!(model["format"], "artifact");
    assert_eq!(model["vocabulary"], json!(219));
    assert_eq!(model["limits"]["max_sentences"], json!(8));
    assert_eq!(model["defaults"]["beam"], json!(4));
    assert_eq!(model["compile_options"]["precision"], json!("f32"));
    assert!(server.stop().success());
}

/// With room for one waiting request, a burst of them is partly turned away: 503 with
/// `Retry-After` and a JSON message, while every request let in is answered right.
#[test]
fn a_full_queue_answers_503_and_the_rest_are_served() {
    let dir = artifact("serve_queue");
    let server = Server::start(&dir, &["--queue", "1", "--max-batch-tokens", "1"]);
    let src = std::fs::read_to_string(dir.join("valid.src")).unwrap();
    let text: Vec<&str> = src.lines().cycle().take(64).collect();
    let want = ok(
        &dir,
        &["translate", "--model", "art", "--input", "valid.src"],
    );
    let want: Vec<&str> = want.lines().cycle().take(64).collect();
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let asks: Vec<_> = (0..24)
            .map(|_| s.spawn(|| server.translate(&json!({"text": text}))))
            .collect();
        asks.into_iter().map(|a| a.join().unwrap()).collect()
    });
    let busy = answers.iter().filter(|(s, _)| *s == 503).count();
    assert!(
        busy > 0,
        "24 requests at once, room for 1: some are turned away"
    );
    for (status, answer) in &answers {
        match status {
            200 => assert_eq!(texts(answer), want),
            503 => assert!(answer["error"]["message"]
                .as_str()
                .unwrap()
                .contains("busy: too many requests are waiting (--queue)")),
            other => panic!("status {other}: {answer}"),
        }
    }
    assert!(busy < 24, "the first is always let in");
    let (status, _) = server.translate(&json!({"text": ["s1"]}));
    assert_eq!(status, 200);
    assert!(server.stop().success());
}

/// A connection that sends nothing is closed after `--header-timeout-ms`; a body that
/// stops short is answered 408 after `--body-timeout-ms`; the server goes on.
#[test]
fn silent_and_slow_clients_are_timed_out() {
    let dir = artifact("serve_timeouts");
    let server = Server::start(
        &dir,
        &["--header-timeout-ms", "300", "--body-timeout-ms", "300"],
    );
    let started = std::time::Instant::now();
    let mut idle = TcpStream::connect(&server.addr).unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut got = Vec::new();
    let n = idle.read_to_end(&mut got).unwrap_or(0);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(10),
        "closed after {waited:?} ({n} bytes)"
    );
    let mut slow = TcpStream::connect(&server.addr).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let head = "POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                Content-Length: 100\r\nConnection: close\r\n\r\n{\"text\": [";
    slow.write_all(head.as_bytes()).unwrap();
    let mut answer = String::new();
    slow.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("did not arrive within 300 ms (--body-timeout-ms)"),
        "{answer}"
    );
    let (status, _) = server.translate(&json!({"text": ["s1 s2"]}));
    assert_eq!(status, 200);
    assert!(server.stop().success());
}

/// SIGTERM while a request is being translated: its answer still comes, whole, and the
/// server exits 0.
#[test]
fn sigterm_lets_the_request_in_flight_finish() {
    let dir = artifact("serve_sigterm");
    // A batch gathered for 1.5 s: the request is surely in flight when SIGTERM comes.
    let server = Server::start(&dir, &["--max-wait-ms", "1500"]);
    let want = ok(
        &dir,
        &["translate", "--model", "art", "--input", "valid.src"],
    );
    let first = want.lines().next().unwrap().to_string();
    let src = std::fs::read_to_string(dir.join("valid.src")).unwrap();
    let line = src.lines().next().unwrap().to_string();
    std::thread::scope(|s| {
        let asked = s.spawn(|| server.translate(&json!({"text": [line]})));
        std::thread::sleep(Duration::from_millis(500));
        let pid = server.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        let (status, answer) = asked.join().unwrap();
        assert_eq!(status, 200, "{answer}");
        assert_eq!(texts(&answer), [first]);
    });
    let mut server = server;
    assert!(server.child.wait().unwrap().success());
    drop(server);
}
