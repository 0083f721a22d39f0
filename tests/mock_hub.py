"""A local stand-in for the Hugging Face Hub's HTTP API: the endpoints `huggingface_hub` uses to publish a folder.

It speaks create repo, validate YAML, list files (tree), download a file (resolve), preupload and commit (regular,
base64-inline files and deletions), keeps what it was sent, and can be told to refuse commits, so that publishing is tested end to end over real HTTP on 127.0.0.1.
"""

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml


@dataclass
class HubState:
    repos: dict[str, dict] = field(default_factory=dict)
    files: dict[str, dict[str, bytes]] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    authorizations: set[str] = field(default_factory=set)
    refuse_commits: bool = False


def _handler(state: HubState):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            return None

        def _reply(self, status: int, body: dict) -> None:
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _serve_file(self, method: str) -> bool:
            """`/{repo}/resolve/{revision}/{path}` (what `hf_hub_download` asks for); False for other paths."""
            match = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", self.path.split("?")[0])
            if match is None:
                return False
            content = state.files.get(match.group(1), {}).get(match.group(3))
            if content is None:
                self._reply(404, {"error": f"Entry not found: {match.group(3)}"})
                return True
            self.send_response(200)
            self.send_header("Content-Length", str(len(content)))
            self.send_header("ETag", f'"{hashlib.sha1(content).hexdigest()}"')
            self.send_header("X-Repo-Commit", "1" * 40)
            self.end_headers()
            if method == "GET":
                self.wfile.write(content)
            return True

        def do_HEAD(self) -> None:
            state.requests.append(("HEAD", self.path.split("?")[0]))
            if not self._serve_file("HEAD"):
                self._reply(404, {"error": "Not found"})

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            state.requests.append(("GET", path))
            if self._serve_file("GET"):
                return None
            match = re.match(r"^/api/models/(.+)/tree/([^/]+)$", path)
            if match is None or match.group(1) not in state.repos:
                return self._reply(404, {"error": f"Not found: {path}"})
            files = state.files[match.group(1)]
            return self._reply(200, [{"type": "file", "path": name, "size": len(content),
                                      "oid": hashlib.sha1(content).hexdigest()} for name, content in sorted(files.items())])

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            body = self.rfile.read(length)
            path = self.path.split("?")[0]
            state.requests.append(("POST", path))
            state.authorizations.add(self.headers.get("authorization", ""))
            if path == "/api/repos/create":
                request = json.loads(body)
                repo_id = f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
                state.repos[repo_id] = request
                state.files.setdefault(repo_id, {})
                return self._reply(200, {"url": f"http://{self.headers['host']}/{repo_id}", "name": repo_id})
            if path == "/api/validate-yaml":
                content = json.loads(body)["content"]
                match = re.match(r"^---\n(.*?)\n---\n", content, re.S)
                try:
                    yaml.safe_load(match.group(1)) if match else None
                except yaml.YAMLError as error:
                    return self._reply(400, {"errors": [{"message": str(error)}]})
                return self._reply(200, {"errors": [], "warnings": []})
            match = re.match(r"^/api/models/(.+)/(preupload|commit)/([^/]+)$", path)
            if match is None or match.group(1) not in state.repos:
                return self._reply(404, {"error": f"Repository not found: {path}"})
            repo_id, action = match.group(1), match.group(2)
            if action == "preupload":
                files = json.loads(body)["files"]
                return self._reply(200, {"files": [
                    {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None} for f in files
                ]})
            if state.refuse_commits:
                return self._reply(403, {"error": f"You don't have the rights to write to {repo_id}"})
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    state.files[repo_id][item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                elif item["key"] == "deletedFile":
                    state.files[repo_id].pop(item["value"]["path"], None)
            return self._reply(200, {"commitUrl": f"http://{self.headers['host']}/{repo_id}/commit/{'1' * 40}",
                                     "commitOid": "1" * 40})

    return Handler


class MockHub:
    """Serves `HubState` on 127.0.0.1 (a free port) in a thread; `endpoint` is its URL. A context manager."""

    def __init__(self):
        self.state = HubState()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self.state))
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "MockHub":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()
