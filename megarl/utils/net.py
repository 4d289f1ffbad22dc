"""Which local address and interface a process uses to reach another host.

On a cluster the hostname often resolves to loopback (Debian's /etc/hosts maps it to
127.0.1.1), and gloo picks its interface by resolving the hostname unless GLOO_SOCKET_IFNAME
says otherwise: a gloo group spanning hosts then advertises 127.0.0.1 to its peers and never
connects. megarl asks the kernel for the route toward the peer instead, and binds there.
A user's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME always win.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket

logger = logging.getLogger(__name__)


def route_address(toward: str) -> str:
    """This host's address on the interface that routes to `toward` (loopback for loopback).
    A UDP connect sends nothing; it only asks the kernel for a route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(toward), 9))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def interface_of(address: str) -> str | None:
    """The name of the interface that holds `address`, or None."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError):
        return False


def pin_socket_interfaces(toward: str) -> str | None:
    """Set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the interface that routes to
    `toward`, unless the user set them; call before the process makes its first group.
    Returns the interface chosen, or None where nothing was set."""
    iface = interface_of(route_address(toward))
    if iface is None:
        return None
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if var not in os.environ:
            os.environ[var] = iface
    if os.environ["GLOO_SOCKET_IFNAME"] != iface:
        logger.info("GLOO_SOCKET_IFNAME=%s (set by the user; the route to %s is on %s)",
                    os.environ["GLOO_SOCKET_IFNAME"], toward, iface)
    return iface


def gloo_device(toward: str):
    """A gloo device for a group whose rendezvous is at `toward`: on the interface named by
    GLOO_SOCKET_IFNAME when set, else bound to the local address that routes there."""
    import torch.distributed as dist

    env = os.environ.get("GLOO_SOCKET_IFNAME")
    if env:
        return dist.ProcessGroupGloo.create_device(interface=env.split(",")[0])
    return dist.ProcessGroupGloo.create_device(hostname=route_address(toward))
