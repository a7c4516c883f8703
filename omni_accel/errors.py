"""The one error type users see from omni_accel."""


class AccelError(ValueError):
    """Bad omni_accel input or state; the message names the value and the fix."""


class NotAvailableYet(AccelError):
    """A knob the config accepts whose pass has not been built yet.

    Raised instead of silently ignoring the knob, so a user never believes a feature is on when it is not.
    """

    def __init__(self, knob: str, value: object, issue: str):
        super().__init__(
            f"{knob}={value!r} is not available yet in this version of omni_accel (planned in {issue}). "
            f"Remove {knob} from the call (or leave it at its default) to run without it."
        )
