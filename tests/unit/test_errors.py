import pytest

import transfer
from transfer import errors as E


def all_error_classes() -> list[type[E.TransferError]]:
    out, todo = [], [E.TransferError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def test_codes_are_unique_and_stable() -> None:
    codes = [c.code for c in all_error_classes()]
    assert len(codes) == len(set(codes))
    # A few codes are part of the published protocol: they must never move.
    assert (E.MalformedFrame.code, E.OutOfBounds.code, E.NotOwner.code, E.OutOfSharedMemory.code, E.PeerDisconnected.code) == (101, 204, 203, 301, 613)


@pytest.mark.parametrize("cls", all_error_classes())
def test_wire_round_trip_rebuilds_the_same_class(cls: type[E.TransferError]) -> None:
    code, name, msg = cls("boom").to_wire()
    again = E.error_for_code(code, msg)
    assert type(again) is cls and again.message == "boom" and name == cls.__name__


def test_unknown_code_keeps_its_number() -> None:
    err = E.error_for_code(12345, "from the future")
    assert type(err) is E.TransferError and "12345" in str(err)


def test_public_names() -> None:
    for name in E.__all__:
        assert hasattr(transfer, name)
