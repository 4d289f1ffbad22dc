"""megarl.utils.launch.free_port: ports that no outgoing connection can take before the bind."""
import socket

from megarl.utils import launch


def test_free_ports_lie_below_the_ephemeral_range_and_bind():
    low = launch._ephemeral_low()
    ports = {launch.free_port() for _ in range(20)}
    assert len(ports) > 1  # drawn, not one fixed port
    for port in ports:
        assert launch._PORTS_FROM <= port < low, (port, low)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_returned(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # a range of one port, and that one in use: the kernel's choice, not the taken one
        monkeypatch.setattr(launch, "_PORTS_FROM", taken)
        monkeypatch.setattr(launch, "_ephemeral_low", lambda: taken + 1001)
        monkeypatch.setattr(launch.random.SystemRandom, "randint", lambda self, a, b: taken)
        assert launch.free_port() != taken
