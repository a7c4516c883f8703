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


def copy_refusal(what: str, action: str = "pickled") -> AccelError:
    """The error for pickling (or deep-copying) something omni_accel's patches are bound to."""
    return AccelError(
        f"{what} cannot be {action} while omni_accel's patches are on it (hooks and wrappers that "
        "belong to this process and to the accelerated pipeline). Call omni_accel.restore(pipe) first (pickle or "
        "copy the plain pipeline, then accelerate the copy), or keep the weights with save_pretrained() / "
        "state_dict()."
    )
