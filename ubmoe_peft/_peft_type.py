"""Adds ``UBMOE`` to PEFT's ``PeftType`` enum.

``peft.register_peft_method`` only accepts names that are already members of ``PeftType``, and PEFT offers no
public way to add one, so the member is added here with the enum's own bookkeeping (the same three tables that
``enum`` fills for a member declared in the class body). ``tests/test_core.py::test_registered_with_peft`` and
``::test_registration_survives_reimport`` check the result the way PEFT uses it: lookup by value, by name, iteration,
and JSON round trips of ``adapter_config.json``.
"""

from __future__ import annotations

from peft.utils import PeftType


def _add_peft_type(name: str) -> PeftType:
    if name in PeftType.__members__:
        return PeftType[name]
    member = str.__new__(PeftType, name)
    member._name_ = name
    member._value_ = name
    member.__objclass__ = PeftType
    add_member = getattr(PeftType, "_add_member_", None)  # Python >= 3.13 has a helper for exactly this
    if add_member is not None:
        add_member(name, member)
    else:
        type.__setattr__(PeftType, name, member)
        PeftType._member_map_[name] = member
        PeftType._member_names_.append(name)
    PeftType._value2member_map_[name] = member
    return member


UBMOE_PEFT_TYPE = _add_peft_type("UBMOE")
