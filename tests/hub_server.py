"""A loopback HTTP server answering the few Hub endpoints huggingface_hub's upload path calls, so the
real client runs end to end offline (reached through HF_ENDPOINT). Tests only.

Endpoints: repo creation, branch creation, YAML validation, pre-upload (every file "regular": sent
inline in the commit), and the commit itself, whose files are decoded and kept in `received` and
whose (repo, branch, summary) is appended to `commits`. `fail_commits` makes the commit endpoint
answer 500, as an unavailable Hub would.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from urllib.parse import unquote
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["LoopbackHub"]


class LoopbackHub:
    def __init__(self):
        self.received: dict[str, dict[str, bytes]] = {}  # repo id → path → content
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, headers)
        self.commits: list[tuple[str, str, str]] = []  # (repo id, branch, commit summary)
        self.created: dict[str, dict] = {}  # repo id: the creation request (its "visibility")
        self.fail_commits = False
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hub.requests.append(("POST", self.path, dict(self.headers)))
                path = self.path.split("?")[0]
                if path == "/api/repos/create":
                    request = json.loads(body)
                    repo = f"{request.get('organization') or 'user'}/{request['name']}"
                    hub.created[repo] = request
                    return self._reply(200, {"url": f"{hub.endpoint}/{repo}", "name": repo, "id": repo})
                if path == "/api/validate-yaml":
                    return self._reply(200, {"errors": [], "warnings": []})
                if m := re.fullmatch(r"/api/models/(.+)/preupload/[^/]+", path):
                    files = json.loads(body)["files"]
                    return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                       for f in files]})
                if re.fullmatch(r"/api/models/(.+)/branch/[^/]+", path):
                    return self._reply(200, {})
                if m := re.fullmatch(r"/api/models/(.+)/commit/([^/]+)", path):
                    if hub.fail_commits:
                        return self._reply(500, {"error": "the Hub is unavailable"})
                    repo = m.group(1)
                    for line in body.decode().splitlines():
                        item = json.loads(line)
                        if item["key"] == "header":
                            hub.commits.append((repo, unquote(m.group(2)), item["value"]["summary"]))
                        if item["key"] == "file":
                            value = item["value"]
                            hub.received.setdefault(repo, {})[value["path"]] = base64.b64decode(value["content"])
                    return self._reply(200, {"commitUrl": f"{hub.endpoint}/{repo}/commit/{'0' * 40}",
                                             "commitOid": "0" * 40, "pullRequestUrl": None})
                return self._reply(404, {"error": f"not served here: {path}"})

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> LoopbackHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
