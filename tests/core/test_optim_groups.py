"""A param group's replay settings (shadow/core/optimizers): the trainer reads them from the
optimizer, the commit record carries their wire map unchanged, the worker refuses a
malformed one naming the key."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from shadow.core.optimizers import AdamGroup, SgdGroup, group_from_wire
from shadow.wire import frames as F
from shadow.worker.commit import decode_commit
from trainer_hooks.optim.describe import replay_groups, wire_groups

ADAM = AdamGroup(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=True, maximize=False, decoupled=True)
SGD = SgdGroup(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-4, nesterov=False, maximize=True)


def test_the_wire_maps_are_the_ones_commit_records_carry():
    assert list(ADAM.to_wire().items()) == [
        ("lr", 3e-4),
        ("betas", [0.9, 0.95]),
        ("eps", 1e-8),
        ("weight_decay", 0.1),
        ("amsgrad", True),
        ("maximize", False),
        ("decoupled", True),
    ]
    assert list(SGD.to_wire().items()) == [
        ("lr", 0.1),
        ("momentum", 0.9),
        ("dampening", 0.1),
        ("weight_decay", 1e-4),
        ("nesterov", False),
        ("maximize", True),
    ]


@pytest.mark.parametrize("group", [ADAM, SGD], ids=["adam", "sgd"])
def test_to_wire_and_from_wire_round_trip(group):
    cls = type(group)
    assert cls.from_wire(group.to_wire()) == group
    assert group_from_wire(group.to_wire()) == group
    packed = msgpack.unpackb(msgpack.packb(group.to_wire(), use_bin_type=True), raw=False)  # as it travels
    assert packed == group.to_wire() and cls.from_wire(packed) == group
    assert cls.from_wire(dict(group.to_wire(), lr=1)).lr == 1  # an int is a number


def _bad(wire: dict, **change) -> dict:
    out = dict(wire, **{k: v for k, v in change.items() if v is not _DROP})
    for k, v in change.items():
        if v is _DROP:
            del out[k]
    return out


_DROP = object()
REFUSED = [
    # (kind, wire map, the key the message must name)
    ("adam", _bad(ADAM.to_wire(), lr=True), "group lr is not a number"),
    ("adam", _bad(ADAM.to_wire(), eps="1e-8"), "group eps is not a number"),
    ("adam", _bad(ADAM.to_wire(), maximize=1), "group maximize is not a bool"),
    ("adam", _bad(ADAM.to_wire(), maximize="yes"), "group maximize is not a bool"),
    ("adam", _bad(ADAM.to_wire(), betas=[0.9]), "group betas is not a pair"),
    ("adam", _bad(ADAM.to_wire(), betas=["0.9", 0.999]), "group betas is not a pair"),
    ("adam", _bad(ADAM.to_wire(), betas=[0.9, False]), "group betas is not a pair"),
    ("adam", _bad(ADAM.to_wire(), betas=0.9), "group betas is not a pair"),
    ("adam", _bad(ADAM.to_wire(), amsgrad=_DROP), "lacks key 'amsgrad'"),
    ("adam", _bad(ADAM.to_wire(), nesterov=True), "has unknown key 'nesterov'"),
    ("sgd", _bad(SGD.to_wire(), momentum=False), "group momentum is not a number"),
    ("sgd", _bad(SGD.to_wire(), nesterov=0), "group nesterov is not a bool"),
    ("sgd", _bad(SGD.to_wire(), dampening=_DROP), "lacks key 'dampening'"),
    ("sgd", _bad(SGD.to_wire(), betas=[0.9, 0.99]), "has unknown key 'betas'"),
]


@pytest.mark.parametrize("kind, wire, message", REFUSED)
def test_from_wire_refuses_a_malformed_group_naming_the_key(kind, wire, message):
    cls = AdamGroup if kind == "adam" else SgdGroup
    with pytest.raises(ValueError, match=message):
        cls.from_wire(wire)
    with pytest.raises(ValueError, match=message):
        group_from_wire(wire)


def test_from_wire_refuses_what_is_not_a_map():
    for cls in (AdamGroup, SgdGroup):
        with pytest.raises(ValueError, match="not a map"):
            cls.from_wire([1, 2])
    with pytest.raises(ValueError, match="not a map"):
        group_from_wire(None)


def _body(groups: list) -> bytes:
    replay = {"iteration": 4, "rank": 0, "sent": 0, "skipped": [], "groups": groups, "clip": None, "bootstrap": False}
    return msgpack.packb({"replay": replay, "blob": None}, use_bin_type=True)


HEADER = F.Header(F.Kind.COMMIT, F.Field.GRAD, 1, 1, 0, 1, 0, 4, 0, ())


@pytest.mark.parametrize("group", [ADAM, SGD], ids=["adam", "sgd"])
def test_the_worker_decodes_a_commits_groups_unchanged(group):
    replay, blob = decode_commit(_body([group.to_wire()]), HEADER, 1, 1)
    assert replay["groups"] == [group.to_wire()] and blob is None
    assert type(group).from_wire(replay["groups"][0]) == group


@pytest.mark.parametrize("kind, wire, message", REFUSED + [("adam", [1, 2], "not a map")])
def test_the_worker_refuses_a_malformed_group_as_a_bad_commit(kind, wire, message):
    with pytest.raises(F.FrameError, match=message) as err:
        decode_commit(_body([wire]), HEADER, 1, 1)
    assert err.value.reason == "bad_commit"


def _params(n: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(3)) for _ in range(n)]


def _adam_groups() -> list[dict]:
    ps = _params(2)
    return [
        {"params": [ps[0]]},
        {"params": [ps[1]], "lr": 0.5, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.0, "maximize": True},
    ]


@pytest.mark.parametrize(
    "make, decoupled",
    [
        (lambda: torch.optim.AdamW(_adam_groups(), lr=1e-3, weight_decay=0.1, amsgrad=True), True),
        (lambda: torch.optim.Adam(_adam_groups(), lr=2e-3, weight_decay=0.01), False),
        (lambda: torch.optim.Adam(_adam_groups(), lr=2e-3, weight_decay=0.01, decoupled_weight_decay=True), True),
    ],
    ids=["adamw", "adam", "adam-decoupled"],
)
def test_replay_groups_of_adam_are_the_optimizers_settings(make, decoupled):
    opt = make()
    groups = replay_groups(opt)
    assert all(type(g) is AdamGroup for g in groups) and len(groups) == len(opt.param_groups)
    for g, pg in zip(groups, opt.param_groups, strict=True):
        assert g == AdamGroup(
            lr=pg["lr"],
            betas=tuple(pg["betas"]),
            eps=pg["eps"],
            weight_decay=pg["weight_decay"],
            amsgrad=pg["amsgrad"],
            maximize=pg["maximize"],
            decoupled=decoupled,
        )
        assert type(g.lr) is float and type(g.betas) is tuple and all(type(b) is float for b in g.betas)
    assert wire_groups(opt) == [g.to_wire() for g in groups]
    assert [AdamGroup.from_wire(w) for w in wire_groups(opt)] == groups


def test_replay_groups_of_sgd_are_the_optimizers_settings():
    ps = _params(2)
    opt = torch.optim.SGD(
        [{"params": [ps[0]]}, {"params": [ps[1]], "lr": 0.5, "momentum": 0.0, "dampening": 0.0, "nesterov": False}],
        lr=0.1,
        momentum=0.9,
        dampening=0.0,
        weight_decay=1e-4,
        nesterov=True,
        maximize=True,
    )
    groups = replay_groups(opt)
    assert all(type(g) is SgdGroup for g in groups)
    want = [
        SgdGroup(
            lr=pg["lr"],
            momentum=pg["momentum"],
            dampening=pg["dampening"],
            weight_decay=pg["weight_decay"],
            nesterov=pg["nesterov"],
            maximize=pg["maximize"],
        )
        for pg in opt.param_groups
    ]
    assert groups == want and groups[1].nesterov is False and groups[0].nesterov is True
    assert [SgdGroup.from_wire(w) for w in wire_groups(opt)] == groups


def test_groups_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ADAM.lr = 1.0  # type: ignore[misc]
