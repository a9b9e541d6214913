"""Forward TCP connections from one address to another (bytes only; TLS passes through).

The real node's kubelet (``e2e.realnode``) runs in a network namespace of its own, where
the apiserver's 127.0.0.1 is not reachable; this forwards the host end of the node's veth
to it. Standard library only, run by path:

    python e2e/tcpforward.py LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT
"""

from __future__ import annotations

import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def main(listen_host: str, listen_port: int, host: str, port: int) -> None:
    async def handle(r1: asyncio.StreamReader, w1: asyncio.StreamWriter) -> None:
        try:
            r2, w2 = await asyncio.open_connection(host, port)
        except OSError:
            w1.close()
            return
        await asyncio.gather(_pipe(r1, w2), _pipe(r2, w1))

    server = await asyncio.start_server(handle, listen_host, listen_port)
    print(f"forwarding {listen_host}:{listen_port} -> {host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], int(a[1]), a[2], int(a[3])))
