"""A few huggingface_hub endpoints on 127.0.0.1, enough for create_repo + upload_folder (regular git uploads)."""
import base64, json, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class HubStub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: list[tuple[str, str, list[str]]] = []
        self.unknown: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                stub.unknown.append("GET " + self.path)
                self._send(404, {"error": "not found"})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                p = self.path.split("?")[0]
                if p == "/api/validate-yaml":  # README.md model card metadata check
                    return self._send(200, {"warnings": [], "errors": []})
                if p == "/api/repos/create":
                    req = json.loads(body)
                    repo = f"{req.get('organization') or 'user'}/{req['name']}"
                    stub.repos.setdefault(repo, {})
                    return self._send(200, {"url": f"{stub.url}/{repo}", "name": repo})
                parts = p.split("/")  # /api/models/<ns>/<name>/<op>/<rev>
                if len(parts) >= 7 and parts[1] == "api" and parts[2] == "models":
                    repo, op = f"{parts[3]}/{parts[4]}", parts[5]
                    if op == "preupload":
                        files = json.loads(body)["files"]
                        return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                           "shouldIgnore": False} for f in files]})
                    if op == "commit":
                        lines = [json.loads(l) for l in body.decode().splitlines() if l.strip()]
                        msg, paths = "", []
                        for item in lines:
                            if item["key"] == "header":
                                msg = item["value"]["summary"]
                            elif item["key"] == "file":
                                v = item["value"]
                                stub.repos.setdefault(repo, {})[v["path"]] = base64.b64decode(v["content"])
                                paths.append(v["path"])
                        stub.commits.append((repo, msg, paths))
                        return self._send(200, {"commitUrl": f"{stub.url}/{repo}/commit/{'0' * 40}",
                                                "commitOid": "0" * 40, "pullRequestUrl": None})
                stub.unknown.append("POST " + self.path)
                self._send(404, {"error": "not found"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
