"""The trainer's endpoint as given on a peer's command line (``--connect``)."""

from __future__ import annotations

import argparse


def check_endpoint(text: str) -> str:
    """``text`` when it is a ZeroMQ endpoint to connect to: ``tcp://HOST:PORT`` with a port in
    [1, 65535] and a host of a host name's or an address's characters (an IPv6 host in brackets,
    ``tcp://[::1]:PORT``), or ``ipc://PATH``. Checked up front because ZeroMQ accepts a port such as
    99999 or 0 (the peer would wait out its timeout) and fails a host with a space at connect time.

    Raises:
        ValueError: naming the bad value and what was expected.
    """
    transport, sep, address = text.partition("://")
    if not sep or transport not in ("tcp", "ipc") or not address:
        raise ValueError(f"{text!r}: expected tcp://HOST:PORT (or ipc://PATH)")
    if transport == "tcp":
        host, colon, port = address.rpartition(":")
        if not colon or not host or host in ("[", "[]"):
            raise ValueError(f"{text!r}: expected tcp://HOST:PORT, e.g. tcp://127.0.0.1:5555")
        name = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not all(c.isascii() and (c.isalnum() or c in ".-_:%") for c in name) or name.startswith(("-", ".")):
            # ZeroMQ raises EINVAL at connect() for these, which would end the peer with a traceback
            raise ValueError(f"{text!r}: host {host!r}, expected a host name or an IP address (letters, digits, "
                             "'.', '-', '_'; an IPv6 address in brackets)")
        if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            raise ValueError(f"{text!r}: port {port!r}, expected an integer in [1, 65535]")
    return text


def endpoint_arg(text: str) -> str:
    """argparse type of ``--connect`` (:func:`check_endpoint`)."""
    try:
        return check_endpoint(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
