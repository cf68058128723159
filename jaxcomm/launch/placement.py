"""Where a launched job's processes run when not all on this machine's own network stack.

By default :func:`jaxcomm.launch.launch` starts every rank, and the job's coordination
service, here, on 127.0.0.1. A :class:`Placement` puts each of them behind a command
prefix instead (``ip netns exec``, ``ssh host``, ...), the service listening on its host's
address and the ranks reaching it by a name that resolves where they run, as on a
cluster. The tests' network namespaces (tests/netns_util.py) are one such placement.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Placement:
    """Command prefixes that place the ranks and the coordination service.

    Attributes:
      rank_prefix: rank -> the argv that runs a command on that rank's host; it must
        ``exec`` the command (same pid), keep its environment, and leave signals to reach
        it (the launcher signals the process group it started).
      service_prefix: the argv that runs a command on the service's host.
      service_address: the address the service listens on there (an interface of its
        host, never 0.0.0.0: the key-value store is unauthenticated).
      coordinator_host: the name or address by which every rank reaches the service.

    Example (two network namespaces; the service in the first)::

        Placement(rank_prefix=lambda r: ["ip", "netns", "exec", f"ns{r}"],
                  service_prefix=["ip", "netns", "exec", "ns0"],
                  service_address="10.10.0.1", coordinator_host="node0")
    """

    rank_prefix: Callable[[int], Sequence[str]]
    service_prefix: Sequence[str] = ()
    service_address: str = "127.0.0.1"
    coordinator_host: str = "127.0.0.1"


#: Every rank and the service here, on 127.0.0.1 (the launcher's default).
LOCAL = Placement(rank_prefix=lambda rank: ())
