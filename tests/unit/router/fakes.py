"""Small fakes shared by the router core tests."""


class FakeClock:
    """A clock the test moves by hand (cores take `clock` as a parameter)."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt
