"""A local test double of the Hugging Face Hub's HTTP API, which the real ``huggingface_hub`` client downloads from.

Point the client at it with ``endpoint=hub.url``, or with ``HF_ENDPOINT=hub.url`` in a child process's environment
(in-process, ``HF_ENDPOINT`` is read once, when ``huggingface_hub`` is imported). Served as huggingface.co serves them:
``GET /api/models/{repo_id}[/revision/{rev}]`` (repo info), ``GET /api/models/{repo_id}/tree/{rev}[/{path}]`` (the file
listing, paged by a ``Link: <...>; rel="next"`` header), ``HEAD``/``GET /{repo_id}/resolve/{rev}/{path}`` (file metadata
and body, ``Range`` honoured). Only model repos exist. Every file is a plain git file (ETag = git blob id, no LFS
redirect), and no ``X-Xet-*`` header or ``xetHash`` is ever sent: the client always takes its plain HTTP path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import sys
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

_SORRY = "Sorry, we can't find the page you are looking for."


def _git_blob_id(content: bytes) -> str:
    """The id git gives a blob: the Hub's ETag of a regular (non-LFS) file, and its ``oid`` in tree listings."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass(frozen=True)
class _Commit:
    sha: str
    files: dict[str, bytes]
    date: str  # the Hub's timestamp format, which the client's parse_datetime insists on


@dataclass
class _Repo:
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, _Commit] = field(default_factory=dict)


class _Response(NamedTuple):
    status: int
    headers: dict[str, str]
    body: bytes
    cut_at: int | None = None  # send only this many body bytes, then drop the connection


class _HubError(Exception):
    """An error answer, in the Hub's shape: the client maps ``X-Error-Code`` to its exception classes."""

    def __init__(self, status: int, message: str, code: str | None = None, **headers: str) -> None:
        super().__init__(message)
        headers = {"Content-Type": "application/json; charset=utf-8", "X-Error-Message": message, **headers}
        if code is not None:
            headers["X-Error-Code"] = code
        self.response = _Response(status, headers, json.dumps({"error": message}).encode())


class FakeHub:
    """A local test double of the Hugging Face Hub's HTTP API on 127.0.0.1 (a free port).

    ``url``: "http://127.0.0.1:PORT", valid after ``start()``. ``requests``: every request answered, in order, as
    (method, raw path with its query string, status, request headers keyed by lower-cased name, e.g. ``h["range"]``).
    ``fail_after_bytes``: when set, the next GET of a file body sends that many bytes of it, then drops the connection
    (once; it resets to None). The client (2.4.0) retries within the same call, after 1 s, with ``Range: bytes=<kept>-``
    where <kept> counts only whole 10 MiB chunks (``constants.DOWNLOAD_CHUNK_SIZE``) it had written: a cut inside the
    first chunk is retried from byte 0, without ``Range``. Its partial files live and die with one call: a later call
    never resumes an earlier one.

    Errors, and what the real client (``snapshot_download``, ``hf_hub_download``, ``HfApi``) raises on them: unknown
    repo, 404 ``X-Error-Code: RepoNotFound`` -> ``RepositoryNotFoundError``; unknown branch or commit, 404
    ``RevisionNotFound`` -> ``RevisionNotFoundError``; unknown file, 404 ``EntryNotFound`` (with ``X-Repo-Commit``) ->
    ``RemoteEntryNotFoundError``, an ``EntryNotFoundError`` (from ``hf_hub_download``: ``snapshot_download`` only
    fetches the files the tree lists). Tokens: see ``__init__``.
    """

    tree_page_size: int = 1000  # entries per tree page: the Hub's page size (lower it to exercise paging)

    def __init__(self, token: str | None = None) -> None:
        """With ``token``, every request must carry ``Authorization: Bearer <token>``, as for a private repo.

        Without any token the answer is the Hub's anti-enumeration one: 401 with ``X-Error-Code: RepoNotFound``, so
        the client raises ``RepositoryNotFoundError`` (status 401), as against huggingface.co. (The client only maps a
        bare 401 to it for ``https://`` URLs, so the code header is what makes it hold for this ``http://`` double.)
        With a wrong token the answer is the Hub's one for a token it does not know: 401 ``X-Error-Message: Invalid
        credentials in Authorization header`` and no code, on which the client raises a plain ``HfHubHTTPError``
        (status 401), not ``RepositoryNotFoundError``. Both are ``HfHubHTTPError`` with ``response.status_code == 401``.
        """
        self.token = token
        self.url = ""
        self.requests: list[tuple[str, str, int, dict[str, str]]] = []
        self.fail_after_bytes: int | None = None
        self.fail_path: str | None = None  # when set, ``fail_after_bytes`` applies to this file path only
        # File paths whose GET answers 500 (the Hub or its CDN failing), every time, until removed from the set.
        self.broken_files: set[str] = set()
        self._repos: dict[str, _Repo] = {}
        self._lock = threading.Lock()
        self._commits_made = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> FakeHub:
        """Serve in a background thread; ``url`` is valid from now on."""
        self._server = _Server(self)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        # A short poll interval keeps stop() fast: serve_forever notices a shutdown only between polls.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-hub", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: the port refuses connections and open keep-alive connections are closed."""
        if self._server is None or self._thread is None:
            return
        self._server.shutdown()
        self._server.drop_connections()
        self._server.server_close()
        self._thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def add_commit(self, repo_id: str, files: dict[str, bytes], branch: str = "main") -> str:
        """A new commit on ``branch`` holding exactly ``files`` (path -> content, paths may contain "/"); returns its
        40-hex commit sha. Earlier commits stay downloadable by their sha."""
        if not repo_id or repo_id.count("/") > 1 or "" in repo_id.split("/"):
            raise ValueError(f"repo_id must be 'name' or 'namespace/name', got {repo_id!r}")
        for path, content in files.items():
            if "" in path.split("/") or not isinstance(content, bytes):
                raise ValueError(f"bad file {path!r}: a relative path without empty parts, and bytes")
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo())
            self._commits_made += 1
            listing = "".join(f"{_git_blob_id(content)} {path}\n" for path, content in sorted(files.items()))
            parent = repo.branches.get(branch, "")
            seed = f"{repo_id}\n{branch}\n{parent}\n{self._commits_made}\n{listing}"
            sha = hashlib.sha1(seed.encode()).hexdigest()
            date = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
            repo.commits[sha] = _Commit(sha, dict(files), date)
            repo.branches[branch] = sha
        return sha

    def _record(self, method: str, path: str, status: int, headers: dict[str, str]) -> None:
        with self._lock:
            self.requests.append((method, path, status, headers))

    def _answer(self, method: str, target: str, headers: dict[str, str]) -> _Response:
        """The Hub's answer to one request (auth first: private repos answer nothing else to strangers)."""
        if self.token is not None and headers.get("authorization") != f"Bearer {self.token}":
            challenge = {"WWW-Authenticate": 'Bearer realm="Authentication required", charset="UTF-8"'}
            if headers.get("authorization") is None:
                raise _HubError(401, "Invalid username or password.", "RepoNotFound", **challenge)
            raise _HubError(401, "Invalid credentials in Authorization header", **challenge)
        split = urlsplit(target)
        segments = split.path.strip("/").split("/")
        if segments[:2] == ["api", "models"] and len(segments) > 2:
            repo_id, rest = self._split_repo_id(segments[2:])
            if not rest or (rest[0] == "revision" and len(rest) == 2):
                return self._info(repo_id, unquote(rest[1]) if rest else "main")
            if rest[0] == "tree" and len(rest) >= 2:
                return self._tree(repo_id, rest, parse_qs(split.query), split.path)
        elif "resolve" in segments[1:3]:
            repo_id, rest = self._split_repo_id(segments)
            if len(rest) >= 3 and rest[0] == "resolve":
                commit = self._commit(repo_id, unquote(rest[1]))
                return self._file(commit, unquote("/".join(rest[2:])), method, headers.get("range"))
        raise _HubError(404, _SORRY)

    def _split_repo_id(self, segments: list[str]) -> tuple[str, list[str]]:
        """(repo_id, the path segments after it); "namespace/name" ids win over one-part ones like "gpt2"."""
        with self._lock:
            for size in (2, 1):
                repo_id = "/".join(unquote(part) for part in segments[:size])
                if len(segments) >= size and repo_id in self._repos:
                    return repo_id, segments[size:]
        raise _HubError(404, "Repository not found", "RepoNotFound")

    def _commit(self, repo_id: str, revision: str) -> _Commit:
        with self._lock:
            repo = self._repos[repo_id]
            commit = repo.commits.get(repo.branches.get(revision, revision))
        if commit is None:
            raise _HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    def _info(self, repo_id: str, revision: str) -> _Response:
        commit = self._commit(repo_id, revision)
        siblings = [{"rfilename": path} for path in sorted(commit.files)]
        info = {"id": repo_id, "modelId": repo_id, "sha": commit.sha, "lastModified": commit.date, "siblings": siblings}
        info.update(private=self.token is not None, gated=False, disabled=False)
        return _Response(200, {"Content-Type": "application/json; charset=utf-8"}, json.dumps(info).encode())

    def _tree(self, repo_id: str, rest: list[str], query: dict[str, list[str]], path: str) -> _Response:
        commit = self._commit(repo_id, unquote(rest[1]))
        folder = unquote("/".join(rest[2:])).strip("/")
        recursive = query.get("recursive", ["False"])[0].lower() in ("true", "1")
        entries = _tree_entries(commit, folder, recursive)
        if folder and not entries:
            raise _HubError(404, f"{folder} does not exist on {rest[1]}", "EntryNotFound")
        offset = int(query.get("cursor", ["0"])[0])
        end = offset + self.tree_page_size
        headers = {"Content-Type": "application/json; charset=utf-8"}
        if end < len(entries):
            # The client follows the URL as is (no endpoint rewrite), so it must be absolute and point here.
            next_query = urlencode({**{key: values[0] for key, values in query.items()}, "cursor": str(end)})
            headers["Link"] = f'<{self.url}{path}?{next_query}>; rel="next"'
        return _Response(200, headers, json.dumps(entries[offset:end]).encode())

    def _file(self, commit: _Commit, path: str, method: str, range_header: str | None) -> _Response:
        content = commit.files.get(path)
        if content is None:
            # The client caches "this file does not exist at this commit" under the X-Repo-Commit it gets here.
            raise _HubError(404, "Entry not found", "EntryNotFound", **{"X-Repo-Commit": commit.sha})
        name = quote(path.rsplit("/", 1)[-1])
        headers = {
            "Content-Type": "application/octet-stream",
            "ETag": f'"{_git_blob_id(content)}"',
            "X-Repo-Commit": commit.sha,
            "Accept-Ranges": "bytes",
            "Content-Disposition": f"inline; filename*=UTF-8''{name}; filename=\"{name}\";",
        }
        if method != "GET":
            return _Response(200, headers, content)
        if path in self.broken_files:
            raise _HubError(500, "Internal Error")
        status, body = 200, content
        span = _parse_range(range_header, len(content)) if range_header else None
        if span is not None:
            start, end = span
            status, body = 206, content[start : end + 1]
            headers["Content-Range"] = f"bytes {start}-{end}/{len(content)}"
        with self._lock:  # the failure is for one transfer only
            cut_at = None
            if self.fail_path in (None, path):
                cut_at, self.fail_after_bytes = self.fail_after_bytes, None
        return _Response(status, headers, body, cut_at)


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """(first, last) byte of a single ``bytes=`` range; None to ignore the header (and send it all, as HTTP allows)."""
    unit, _, spec = header.partition("=")
    first, dash, last = spec.strip().partition("-")
    if unit.strip() != "bytes" or not dash or "," in spec or not (first + last).isdigit():
        return None
    if not first:  # "bytes=-N": the last N bytes
        return (max(size - int(last), 0), size - 1) if int(last) > 0 and size else None
    if last and int(last) < int(first):
        return None
    if int(first) >= size:
        raise _HubError(416, "Requested range not satisfiable", **{"Content-Range": f"bytes */{size}"})
    return int(first), min(int(last), size - 1) if last else size - 1


def _tree_entries(commit: _Commit, folder: str, recursive: bool) -> list[dict[str, Any]]:
    """The Hub's tree listing of ``folder`` (directories, then files, each sorted); recursive lists every level."""
    prefix = f"{folder}/" if folder else ""
    directories: set[str] = set()
    files: list[dict[str, Any]] = []
    for path in sorted(commit.files):
        if not path.startswith(prefix):
            continue
        parts = path[len(prefix) :].split("/")
        for depth in range(1, len(parts) if recursive else min(len(parts), 2)):
            directories.add(prefix + "/".join(parts[:depth]))
        if recursive or len(parts) == 1:
            content = commit.files[path]
            files.append({"type": "file", "oid": _git_blob_id(content), "size": len(content), "path": path})
    folders = [
        {"type": "directory", "oid": hashlib.sha1(f"{commit.sha}:{path}".encode()).hexdigest(), "size": 0, "path": path}
        for path in sorted(directories)
    ]
    return folders + files


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the Hub: the client pools its connections
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # hub.requests is the log; stderr stays quiet

    def send_response(self, code: int, message: str | None = None) -> None:
        headers = getattr(self, "headers", None)
        recorded = {name.lower(): value for name, value in (headers.items() if headers else [])}
        self.server.hub._record(self.command or "", self.path, code, recorded)
        super().send_response(code, message)

    def _serve(self) -> None:
        headers = {name.lower(): value for name, value in self.headers.items()}
        try:
            response = self.server.hub._answer(self.command, self.path, headers)
        except _HubError as error:
            response = error.response
        self.send_response(response.status)
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if self.command == "HEAD":
            return
        self.wfile.write(response.body[: response.cut_at])
        if response.cut_at is not None:
            # Closing (a FIN) before Content-Length is reached is a transfer dropped mid-way: httpx2 raises
            # RemoteProtocolError, which the client's http_get answers by retrying with `Range: bytes=<received>-`.
            self.close_connection = True

    do_GET = do_HEAD = _serve


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a handler blocked on an idle keep-alive connection never holds up exit

    def __init__(self, hub: FakeHub) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.hub = hub
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        """Close every open connection: a stopped hub must not keep serving the client's pooled keep-alives."""
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):  # already closed by the other side
                connection.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a peer hanging up mid-answer is routine; bugs are not
            super().handle_error(request, client_address)
