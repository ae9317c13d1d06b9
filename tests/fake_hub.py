"""A small fake Hugging Face Hub for tests, served on 127.0.0.1.

It implements what ``huggingface_hub`` (2.x) uses to publish and ``transformers`` uses to
download a model repo:

* ``POST /api/repos/create``, ``DELETE /api/repos/delete``, ``GET /api/models/{repo}[/revision/{rev}]``;
* ``POST /api/validate-yaml`` (the README metadata is parsed with huggingface_hub's own
  ``ModelCard``, the way the Hub refuses bad metadata);
* ``POST /api/models/{repo}/preupload/{rev}``: answers ``uploadMode: regular`` for every file,
  so content travels base64-encoded inside the commit (no LFS/Xet storage to fake);
* ``POST /api/models/{repo}/commit/{rev}`` (ndjson), all-or-nothing: a refused commit stores nothing;
* ``HEAD/GET /{repo}/resolve/{rev}/{path}`` with the ``X-Repo-Commit``/``ETag`` headers
  ``hf_hub_download`` requires, ``GET /api/models/{repo}/tree/{rev}[/{path}]`` and
  ``GET /api/models/{repo}/commits/{rev}``.

Writes need ``Authorization: Bearer <token>``; private repos need it for reads too. Knobs:
``refuse_commits`` (answer commits with 403), ``requests`` (a log of (method, path)). The server
is bounded: it runs in a daemon thread and stops itself after ``lifetime`` seconds.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


@dataclass
class Commit:
    oid: str
    message: str
    files: dict[str, bytes]


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: list[Commit] = field(default_factory=list)

    @property
    def files(self) -> dict[str, bytes]:
        return self.commits[-1].files if self.commits else {}

    @property
    def sha(self) -> str:
        return self.commits[-1].oid if self.commits else "0" * 40


def _sha1(*parts: bytes) -> str:
    h = hashlib.sha1()
    for p in parts:
        h.update(p)
    return h.hexdigest()


class FakeHub:
    def __init__(self, token: str = "hf_fake_write_token", lifetime: float = 600.0):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.refuse_commits = False
        self.requests: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.timer = threading.Timer(lifetime, self.stop)
        self.timer.daemon = True

    def start(self) -> "FakeHub":
        self.thread.start()
        self.timer.start()
        return self

    def stop(self) -> None:
        self.timer.cancel()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _handler_class(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def do_GET(self):
                hub._dispatch(self, "GET")

            def do_HEAD(self):
                hub._dispatch(self, "HEAD")

            def do_POST(self):
                hub._dispatch(self, "POST")

            def do_DELETE(self):
                hub._dispatch(self, "DELETE")

        return Handler

    # ------------------------------------------------------------------ plumbing

    def _reply(self, h, status: int, body=b"", headers: dict | None = None, head: bool = False) -> None:
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            headers = {"Content-Type": "application/json", **(headers or {})}
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, str(v))
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _error(self, h, status: int, message: str, code: str | None = None, head: bool = False, extra=None):
        headers = {"X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._reply(h, status, {"error": message}, headers, head=head)

    def _authorized(self, h) -> bool:
        return h.headers.get("Authorization") == f"Bearer {self.token}"

    def _body(self, h) -> bytes:
        return h.rfile.read(int(h.headers.get("Content-Length") or 0))

    def _repo_for_read(self, h, repo_id: str, head: bool = False) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not self._authorized(h)):
            self._error(h, 404, "Repository not found", "RepoNotFound", head=head)
            return None
        return repo

    def _dispatch(self, h, method: str) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        with self.lock:
            self.requests.append((method, path))
        try:
            self._route(h, method, path)
        except Exception as exc:  # a bug here should show up as a 500, not hang the client
            self._error(h, 500, f"fake hub error: {type(exc).__name__}: {exc}")

    def _route(self, h, method: str, path: str) -> None:
        head = method == "HEAD"
        repo_re = r"(?P<repo>[^/]+/[^/]+)"
        routes = [
            ("POST", r"/api/repos/create", self._create_repo),
            ("DELETE", r"/api/repos/delete", self._delete_repo),
            ("POST", r"/api/validate-yaml", self._validate_yaml),
            ("GET", r"/api/whoami-v2", self._whoami),
            ("POST", rf"/api/models/{repo_re}/preupload/(?P<rev>[^/]+)", self._preupload),
            ("POST", rf"/api/models/{repo_re}/commit/(?P<rev>[^/]+)", self._commit),
            ("GET", rf"/api/models/{repo_re}/commits/(?P<rev>[^/]+)", self._list_commits),
            ("GET", rf"/api/models/{repo_re}/tree/(?P<rev>[^/]+)(?:/(?P<sub>.*))?", self._tree),
            ("GET", rf"/api/models/{repo_re}(?:/revision/(?P<rev>[^/]+))?", self._repo_info),
            ("GET", rf"/{repo_re}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", self._resolve),
            ("HEAD", rf"/{repo_re}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", self._resolve),
        ]
        for m, pattern, fn in routes:
            match = re.fullmatch(pattern, path)
            if m == method and match:
                return fn(h, head=head, **{k: v for k, v in match.groupdict().items()})
        self._error(h, 404, f"fake hub: no route for {method} {path}", head=head)

    # ------------------------------------------------------------------ endpoints

    def _whoami(self, h, head=False):
        if not self._authorized(h):
            return self._error(h, 401, "Invalid credentials in Authorization header")
        self._reply(h, 200, {"type": "user", "name": "user", "orgs": [], "auth": {"accessToken": {"role": "write"}}})

    def _create_repo(self, h, head=False):
        payload = json.loads(self._body(h) or b"{}")
        if not self._authorized(h):
            return self._error(h, 401, "Invalid credentials in Authorization header")
        repo_id = f"{payload.get('organization') or 'user'}/{payload['name']}"
        with self.lock:
            if repo_id in self.repos:
                return self._reply(
                    h, 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo_id}"}
                )
            self.repos[repo_id] = Repo(repo_id, payload.get("visibility") == "private" or bool(payload.get("private")))
        self._reply(h, 200, {"url": f"{self.url}/{repo_id}", "name": repo_id})

    def _delete_repo(self, h, head=False):
        payload = json.loads(self._body(h) or b"{}")
        if not self._authorized(h):
            return self._error(h, 401, "Invalid credentials in Authorization header")
        repo_id = f"{payload.get('organization') or 'user'}/{payload['name']}"
        with self.lock:
            if self.repos.pop(repo_id, None) is None:
                return self._error(h, 404, "Repository not found", "RepoNotFound")
        self._reply(h, 200, {})

    def _validate_yaml(self, h, head=False):
        from huggingface_hub import ModelCard

        payload = json.loads(self._body(h))
        try:
            ModelCard(payload["content"])  # parses metadata, model-index included
        except Exception as exc:
            return self._reply(h, 400, {"errors": [{"message": str(exc).splitlines()[0]}], "warnings": []})
        self._reply(h, 200, {"errors": [], "warnings": []})

    def _repo_info(self, h, repo, rev=None, head=False):
        r = self._repo_for_read(h, repo)
        if r is None:
            return
        if rev not in (None, "main", r.sha):
            return self._error(h, 404, "Invalid rev id", "RevisionNotFound")
        self._reply(
            h,
            200,
            {
                "id": repo,
                "modelId": repo,
                "sha": r.sha,
                "private": r.private,
                "siblings": [{"rfilename": f} for f in sorted(r.files)],
                "tags": [],
                "lastModified": "2026-11-21T00:00:00.000Z",
            },
        )

    def _preupload(self, h, repo, rev, head=False):
        payload = json.loads(self._body(h))
        if not self._authorized(h):
            return self._error(h, 401, "Invalid credentials in Authorization header")
        r = self.repos.get(repo)
        if r is None:
            return self._error(h, 404, "Repository not found", "RepoNotFound")
        files = [
            {
                "path": f["path"],
                "uploadMode": "regular",
                "shouldIgnore": False,
                "oid": _sha1(b"blob", r.files[f["path"]]) if f["path"] in r.files else None,
            }
            for f in payload["files"]
        ]
        self._reply(h, 200, {"files": files, "commitOid": r.sha})

    def _commit(self, h, repo, rev, head=False):
        body = self._body(h)
        if not self._authorized(h):
            return self._error(h, 401, "Invalid credentials in Authorization header")
        r = self.repos.get(repo)
        if r is None:
            return self._error(h, 404, "Repository not found", "RepoNotFound")
        if self.refuse_commits:
            return self._error(h, 403, "You don't have the rights to commit to this repo (fake hub refusal)")
        files = dict(r.files)
        message = ""
        for line in body.splitlines():
            item = json.loads(line)
            if item["key"] == "header":
                message = item["value"]["summary"]
            elif item["key"] == "file":
                files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
            elif item["key"] in ("deletedFile", "deletedFolder"):
                files = {
                    k: v
                    for k, v in files.items()
                    if k != item["value"]["path"] and not k.startswith(item["value"]["path"].rstrip("/") + "/")
                }
            else:  # lfsFile would need an LFS store: this hub always asked for regular uploads
                return self._error(h, 400, f"fake hub: unsupported commit operation {item['key']}")
        oid = _sha1(r.sha.encode(), message.encode(), *[k.encode() + v for k, v in sorted(files.items())])
        with self.lock:
            r.commits.append(Commit(oid, message, files))
        self._reply(
            h,
            200,
            {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None, "success": True},
        )

    def _list_commits(self, h, repo, rev, head=False):
        r = self._repo_for_read(h, repo)
        if r is not None:
            self._reply(
                h,
                200,
                [
                    {
                        "id": c.oid,
                        "title": c.message,
                        "message": c.message,
                        "authors": [],
                        "date": "2026-11-21T00:00:00.000Z",
                    }
                    for c in reversed(r.commits)
                ],
            )

    def _tree(self, h, repo, rev, sub=None, head=False):
        r = self._repo_for_read(h, repo)
        if r is None:
            return
        prefix = (sub or "").strip("/")
        entries = [
            {"type": "file", "path": p, "size": len(b), "oid": _sha1(b"blob", b)}
            for p, b in sorted(r.files.items())
            if not prefix or p.startswith(prefix + "/")
        ]
        if prefix and not entries:
            return self._error(h, 404, f"{prefix} does not exist on main", "EntryNotFound")
        self._reply(h, 200, entries)

    def _resolve(self, h, repo, rev, file, head=False):
        r = self._repo_for_read(h, repo, head=head)
        if r is None:
            return
        if rev not in ("main", r.sha):
            return self._error(h, 404, "Invalid rev id", "RevisionNotFound", head=head)
        if file not in r.files:
            return self._error(h, 404, "Entry not found", "EntryNotFound", head=head, extra={"X-Repo-Commit": r.sha})
        content = r.files[file]
        self._reply(
            h,
            200,
            content,
            {
                "X-Repo-Commit": r.sha,
                "ETag": f'"{_sha1(b"blob", content)}"',
                "Content-Type": "application/octet-stream",
            },
            head=head,
        )
