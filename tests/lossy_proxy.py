"""A TCP proxy in front of the test redis-server that can lose replies: Redis runs the command, the
client never hears back and times out. The failure after which a producer cannot know whether its
send was stored (a network drop on the way back), made deterministic."""

from __future__ import annotations

import socket
import threading


class LossyProxy:
    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.drop_replies = 0
        self._lock = threading.Lock()
        self._srv = socket.socket()
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(64)
        self.port = self._srv.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def lose_next_replies(self, n: int) -> None:
        with self._lock:
            self.drop_replies = n

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if replies:
                    with self._lock:
                        if self.drop_replies > 0:
                            self.drop_replies -= 1
                            continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._srv.close()
