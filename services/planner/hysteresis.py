"""When a new pool size may be applied: cooldowns and a streak before scaling down.

Per role, `Hysteresis.apply(role, current, desired, now)` returns the size to
set now. Scaling up is applied as soon as the up-cooldown since the role's last
change has passed (capacity late is SLO missed), by at most `max_step_up`.
Scaling down needs `down_after` consecutive intervals that all wanted fewer
workers and the (longer) down-cooldown, and moves by at most `max_step_down`
to the largest of those recent wishes, so one quiet interval never removes a
worker the next one needs. The clock is the caller's (`now`, seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import require, setting


@dataclass(frozen=True)
class HysteresisConfig:
    up_cooldown_s: float = setting(30.0, "planner: seconds between two scale-ups of one role")
    down_cooldown_s: float = setting(120.0, "planner: seconds after any change before a scale-down")
    down_after: int = setting(3, "planner: consecutive intervals wanting fewer workers before a scale-down")
    down_after_decode: int = setting(0, "planner: down_after for the decode pool alone (0 = down_after)")
    down_cooldown_decode_s: float = setting(
        -1.0, "planner: down_cooldown_s for the decode pool alone (-1 = down_cooldown_s)"
    )
    max_step_up: int = setting(4, "planner: most workers added to a role at once")
    max_step_down: int = setting(2, "planner: most workers removed from a role at once")

    def __post_init__(self) -> None:
        require(self.up_cooldown_s >= 0 and self.down_cooldown_s >= 0, "cooldowns must be >= 0")
        require(self.down_after >= 1, "down_after must be >= 1")
        require(self.down_after_decode >= 0, "down_after_decode must be >= 0")
        require(self.max_step_up >= 1 and self.max_step_down >= 1, "steps must be >= 1")


@dataclass
class _RoleState:
    last_change_s: float = float("-inf")
    below: list[int] = field(default_factory=list)  # recent wishes below the current size


class Hysteresis:
    def __init__(self, config: HysteresisConfig):
        self.config = config
        self._roles: dict[str, _RoleState] = {}

    def apply(self, role: str, current: int, desired: int, now: float, down_after: int = 0) -> int:
        """The size to set now; `down_after` (> 0) overrides the streak a scale-down needs this time."""
        c = self.config
        st = self._roles.setdefault(role, _RoleState())
        if desired > current:
            st.below.clear()
            if now - st.last_change_s < c.up_cooldown_s:
                return current
            st.last_change_s = now
            return min(desired, current + c.max_step_up)
        if desired == current:
            st.below.clear()
            return current
        after, cooldown = c.down_after, c.down_cooldown_s
        if role == "decode":
            after = c.down_after_decode or after
            cooldown = cooldown if c.down_cooldown_decode_s < 0 else c.down_cooldown_decode_s
        after = down_after or after
        st.below.append(desired)
        del st.below[:-after]
        if len(st.below) < after or now - st.last_change_s < cooldown:
            return current
        target = max(max(st.below), current - c.max_step_down)
        st.last_change_s = now
        st.below.clear()
        return target
