"""An in-memory, Hub-compatible HTTP server for the push tests (stdlib http.server in a thread).

Also a way to try `hf3d push` and `checkpoint.push_to_hub` offline: `python tests/hub_server.py --port 8999
--token hf_local` serves until Ctrl-C and prints a line per commit; point the client at it with
HF_ENDPOINT=http://127.0.0.1:8999 HF_HUB_DISABLE_XET=1 HF_TOKEN=hf_local.

It answers the endpoints huggingface_hub uses to create a repo and a branch, validate a card's
YAML, commit files (regular ones inline, LFS ones through the batch API, a PUT and a verify), and
to download a repo back with snapshot_download (repo info, tree listing, resolve with the headers
the client reads: X-Repo-Commit, ETag / X-Linked-Etag, X-Linked-Size, Content-Length). Xet is not
spoken: clients must run with HF_HUB_DISABLE_XET=1.

Like the Hub, a commit is all or nothing: it is refused (422) unless every LFS object it names was
uploaded. Knobs for the failure tests: `fail_first` (answer the first N requests 503), `fail_commits`
(answer every commit 503: a branch is made, its commit never lands) and
`read_only` (repo ids whose writes get 403) and `ignored` (path suffixes the repo's .gitignore
names: the client leaves such files out of the commit). Every request is logged in `requests`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".npz", ".zip")
LFS_MIN_BYTES = 10 << 20
GITATTRIBUTES = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in LFS_SUFFIXES).encode()
REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"


@dataclass(frozen=True)
class Blob:
    data: bytes
    lfs: bool

    @property
    def git_oid(self) -> str:  # what git would call the blob
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


class Refusal(Exception):
    """An HTTP error answer: status, JSON {"error": message}, and the Hub's X-Error-Code when it sends one."""

    def __init__(self, status: int, message: str, code: str | None = None, **body):
        super().__init__(message)
        self.status, self.code, self.body = status, code, body


class FakeHub:
    """`with FakeHub(token) as hub:` serves on hub.url until the block ends."""

    def __init__(
        self,
        token: str,
        *,
        fail_first: int = 0,
        fail_commits: bool = False,
        read_only: tuple[str, ...] = (),
        ignored: tuple[str, ...] = (),
        port: int = 0,
        say=None,
    ):
        self.token, self.fail_first, self.read_only, self.ignored = token, fail_first, set(read_only), ignored
        self.fail_commits = fail_commits
        self.port, self.say = port, say  # say(line): told of each commit (the command line's server)
        self.repos: dict[str, dict] = {}  # id -> {"private", "branches": {name: oid}, "commits": {oid: {path: Blob}}}
        self.lfs: dict[str, bytes] = {}  # sha256 -> content, as PUT by clients
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self.lock = threading.Lock()
        self.routes = [
            ("POST", r"/api/repos/create", self.create_repo),
            ("POST", r"/api/validate-yaml", self.validate_yaml),
            ("POST", rf"/api/models/{REPO}/branch/(?P<branch>[^/]+)", self.create_branch),
            ("DELETE", rf"/api/models/{REPO}/branch/(?P<branch>[^/]+)", self.delete_branch),
            ("POST", rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)", self.preupload),
            ("POST", rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)", self.commit),
            ("POST", rf"/{REPO}\.git/info/lfs/objects/batch", self.lfs_batch),
            ("POST", rf"/{REPO}\.git/info/lfs/objects/verify", self.lfs_verify),
            ("PUT", r"/lfs-upload/(?P<oid>[0-9a-f]{64})", self.lfs_put),
            ("GET", rf"/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?", self.repo_info),
            ("GET", rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?", self.tree),
            ("GET", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", self.resolve),
            ("HEAD", rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)", self.resolve),
        ]

    # -- lifecycle ----------------------------------------------------------------------------------
    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                hub.handle(self)

            do_HEAD = do_POST = do_PUT = do_DELETE = do_GET

            def log_message(self, *args):  # quiet; `requests` keeps the log
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def calls(self, method: str, pattern: str) -> int:
        """How many logged requests match `method` and the path regex `pattern`."""
        return sum(1 for m, p, _ in self.requests if m == method and re.fullmatch(pattern, p))

    def files(self, repo_id: str, rev: str = "main") -> dict[str, Blob]:
        repo = self.repos[repo_id]
        return repo["commits"][repo["branches"].get(rev, rev)]

    # -- request plumbing ---------------------------------------------------------------------------
    def handle(self, req: BaseHTTPRequestHandler) -> None:
        url = urlsplit(req.path)
        path, query = unquote(url.path), parse_qs(url.query)
        body = _read_body(req)
        status, headers, payload = 200, {}, b""
        with self.lock:
            try:
                if self.fail_first > 0:
                    self.fail_first -= 1
                    raise Refusal(503, "Service Unavailable (injected by the test server)")
                for method, pattern, fn in self.routes:
                    m = re.fullmatch(pattern, path)
                    if m and method == req.command:
                        status, headers, payload = fn(req, body, query, **m.groupdict())
                        break
                else:
                    raise Refusal(404, f"no route for {req.command} {path}")
            except Refusal as e:
                status, payload = e.status, json.dumps({"error": str(e), **e.body}).encode()
                headers = {"X-Error-Message": str(e), **({"X-Error-Code": e.code} if e.code else {})}
            self.requests.append((req.command, path, status))
        if isinstance(payload, (dict, list)):
            payload = json.dumps(payload).encode()
            headers.setdefault("Content-Type", "application/json")
        req.send_response(status)
        for k, v in headers.items():
            req.send_header(k, v)
        req.send_header("Content-Length", headers.get("Content-Length", str(len(payload))))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(payload)

    def _auth(self, req, repo_id: str | None = None, *, write: bool) -> None:
        given = req.headers.get("Authorization")
        if given is not None and given != f"Bearer {self.token}":
            raise Refusal(401, "Invalid credentials in Authorization header")
        repo = self.repos.get(repo_id) if repo_id else None
        if repo_id and repo is None:
            raise Refusal(404 if given else 401, "Repository not found", "RepoNotFound")
        if given is None and (write or (repo and repo["private"])):
            raise Refusal(401, "Repository not found" if repo else "Unauthorized", "RepoNotFound" if repo else None)
        if write and repo_id in self.read_only:
            raise Refusal(403, f"You don't have the rights to write to {repo_id}")

    def _head(self, repo_id: str, rev: str) -> str:
        oid = self.repos[repo_id]["branches"].get(rev, rev)
        if oid not in self.repos[repo_id]["commits"]:
            raise Refusal(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return oid

    def _new_commit(self, repo_id: str, branch: str, tree: dict[str, Blob]) -> str:
        repo = self.repos[repo_id]
        oid = hashlib.sha1(f"{repo_id}:{branch}:{len(repo['commits'])}".encode()).hexdigest()
        repo["commits"][oid] = tree
        repo["branches"][branch] = oid
        return oid

    # -- write endpoints ----------------------------------------------------------------------------
    def create_repo(self, req, body, query):
        data = json.loads(body)
        repo_id = f"{data['organization']}/{data['name']}" if data.get("organization") else f"user/{data['name']}"
        self._auth(req, write=True)
        if repo_id in self.read_only:
            raise Refusal(403, f"You don't have the rights to create a model under {repo_id.split('/')[0]}")
        if repo_id in self.repos:
            raise Refusal(409, "You already created this model repo", url=f"{self.url}/{repo_id}")  # as the Hub
        private = data.get("private") or data.get("visibility") == "private"
        self.repos[repo_id] = {"private": bool(private), "branches": {}, "commits": {}}
        self._new_commit(repo_id, "main", {".gitattributes": Blob(GITATTRIBUTES, lfs=False)})
        return 200, {}, {"url": f"{self.url}/{repo_id}", "name": repo_id}

    def create_branch(self, req, body, query, repo, branch):
        self._auth(req, repo, write=True)
        branch = unquote(branch)
        if branch in self.repos[repo]["branches"]:
            raise Refusal(409, f"Branch {branch} already exists")
        start = self._head(repo, (json.loads(body or b"{}")).get("startingPoint") or "main")
        self.repos[repo]["branches"][branch] = start
        return 200, {}, {}

    def delete_branch(self, req, body, query, repo, branch):
        self._auth(req, repo, write=True)
        branch = unquote(branch)
        if branch == "main" or branch not in self.repos[repo]["branches"]:
            raise Refusal(404 if branch != "main" else 403, f"cannot delete branch {branch}")
        del self.repos[repo]["branches"][branch]
        return 200, {}, {}

    def validate_yaml(self, req, body, query):
        content = json.loads(body)["content"]
        m = re.match(r"---\n(.*?)\n---\n", content, re.S)
        try:
            meta = yaml.safe_load(m.group(1)) if m else {}
        except yaml.YAMLError as e:
            return 400, {}, {"errors": [{"message": f"invalid YAML: {e}"}]}
        errors = [] if isinstance(meta, dict) else ["metadata must be a YAML mapping"]
        for key in ("library_name", "license", "pipeline_tag", "base_model") if not errors else ():
            if key in meta and not isinstance(meta[key], str):
                errors.append(f'"{key}" must be a string')
        for key in ("tags", "datasets") if not errors else ():
            if key in meta and not (isinstance(meta[key], list) and all(isinstance(x, str) for x in meta[key])):
                errors.append(f'"{key}" must be a list of strings')
        if not errors and "base_model" in meta and not re.fullmatch(r"[\w.-]+/[\w.-]+", meta["base_model"]):
            errors.append('"base_model" must be a Hub model id')
        return (400 if errors else 200), {}, {"errors": [{"message": e} for e in errors], "warnings": []}

    def preupload(self, req, body, query, repo, rev):
        self._auth(req, repo, write=True)
        self._head(repo, unquote(rev))
        files = json.loads(body)["files"]
        modes = [
            {
                "path": f["path"],
                "uploadMode": _mode(f["path"], f["size"]),
                "shouldIgnore": f["path"].endswith(self.ignored),
            }
            for f in files
        ]
        return 200, {}, {"files": modes, "commitOid": self._head(repo, unquote(rev))}

    def lfs_batch(self, req, body, query, repo):
        self._auth(req, repo, write=True)
        objects = []
        for obj in json.loads(body)["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.lfs:
                entry["actions"] = {
                    "upload": {"href": f"{self.url}/lfs-upload/{obj['oid']}", "header": {}},
                    "verify": {"href": f"{self.url}/{repo}.git/info/lfs/objects/verify", "header": {}},
                }
            objects.append(entry)
        return 200, {}, {"transfer": "basic", "objects": objects}

    def lfs_put(self, req, body, query, oid):  # a pre-signed storage URL: no Authorization, like S3
        if hashlib.sha256(body).hexdigest() != oid:
            raise Refusal(400, "content does not match the oid")
        self.lfs[oid] = body
        return 200, {"ETag": f'"{oid}"'}, b""

    def lfs_verify(self, req, body, query, repo):
        self._auth(req, repo, write=True)
        obj = json.loads(body)
        if len(self.lfs.get(obj["oid"], b"")) != obj["size"] or obj["oid"] not in self.lfs:
            raise Refusal(404, f"LFS object {obj['oid']} was not uploaded")
        return 200, {}, {}

    def commit(self, req, body, query, repo, rev):
        self._auth(req, repo, write=True)
        if self.fail_commits:
            raise Refusal(503, "Service Unavailable (injected by the test server: commits fail)")
        branch = unquote(rev)
        tree = dict(self.files(repo, self._head(repo, branch)))
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        if not lines or lines[0]["key"] != "header" or not lines[0]["value"].get("summary"):
            raise Refusal(400, "the commit must start with a header line that has a summary")
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                tree[value["path"]] = Blob(base64.b64decode(value["content"]), lfs=False)
            elif line["key"] == "lfsFile":
                data = self.lfs.get(value["oid"])
                if data is None or len(data) != value["size"]:
                    raise Refusal(422, f"LFS object for {value['path']} was not uploaded: nothing committed")
                tree[value["path"]] = Blob(data, lfs=True)
            elif line["key"] == "deletedFile":
                tree.pop(value["path"], None)
            else:
                raise Refusal(400, f"unsupported commit operation {line['key']!r}")
        oid = self._new_commit(repo, branch, tree)
        if self.say is not None:
            self.say(f"commit {oid[:8]} to {repo} branch {branch}: {', '.join(sorted(tree))}")
        return 200, {}, {"success": True, "commitOid": oid, "commitUrl": f"{self.url}/{repo}/commit/{oid}"}

    # -- read endpoints -----------------------------------------------------------------------------
    def repo_info(self, req, body, query, repo, rev=None):
        self._auth(req, repo, write=False)
        oid = self._head(repo, unquote(rev or "main"))
        siblings = [{"rfilename": p} for p in sorted(self.files(repo, oid))]
        return 200, {}, {"id": repo, "sha": oid, "private": self.repos[repo]["private"], "siblings": siblings}

    def tree(self, req, body, query, repo, rev, path=None):
        self._auth(req, repo, write=False)
        files = self.files(repo, self._head(repo, unquote(rev)))
        prefix = f"{path.strip('/')}/" if path else ""
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        entries, folders = [], set()
        for p, blob in sorted(files.items()):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix) :]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/")[0])
                continue
            entry = {"type": "file", "path": p, "size": len(blob.data), "oid": blob.git_oid}
            if blob.lfs:
                entry["lfs"] = {"oid": blob.sha256, "size": len(blob.data), "pointerSize": 134}
            entries.append(entry)
        entries += [{"type": "directory", "path": f, "size": 0, "oid": "0" * 40} for f in sorted(folders)]
        return 200, {}, entries

    def resolve(self, req, body, query, repo, rev, path):
        self._auth(req, repo, write=False)
        oid = self._head(repo, unquote(rev))
        blob = self.files(repo, oid).get(path)
        if blob is None:
            raise Refusal(404, f"{path} does not exist at {rev}", "EntryNotFound")
        headers = {"X-Repo-Commit": oid, "ETag": f'"{blob.git_oid}"', "Content-Type": "application/octet-stream"}
        if blob.lfs:
            headers.update({"X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": str(len(blob.data))})
        return 200, headers, blob.data


def _mode(path: str, size: int) -> str:
    return "lfs" if path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_BYTES else "regular"


def _read_body(req: BaseHTTPRequestHandler) -> bytes:
    if req.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while (size := int(req.rfile.readline().split(b";")[0], 16)) > 0:
            chunks.append(req.rfile.read(size))
            req.rfile.readline()
        req.rfile.readline()
        return b"".join(chunks)
    return req.rfile.read(int(req.headers.get("Content-Length") or 0))


def main() -> None:
    import argparse
    import time

    parser = argparse.ArgumentParser(description="an in-memory Hub on 127.0.0.1 for trying pushes offline")
    parser.add_argument("--port", type=int, default=8999, help="port to listen on (default 8999)")
    parser.add_argument("--token", default="hf_local", help="the token clients must send (default hf_local)")
    args = parser.parse_args()
    with FakeHub(args.token, port=args.port, say=lambda line: print(line, flush=True)) as hub:
        print(f"serving an in-memory Hub on {hub.url}; use it with", flush=True)
        print(f"  HF_ENDPOINT={hub.url} HF_HUB_DISABLE_XET=1 HF_TOKEN={args.token}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
