"""Pipeline stages' commit records (issue 55): each rank speaks for its stage's parameters
and param groups (``owns``, ``trainer_hooks.capture.stages.Stages.globalize``), the workers
check that ranks agree where they overlap and join the records into one
(``shadow.worker.commit.merge``); a record claiming what it does not own is malformed."""

import msgpack
import pytest

from shadow.core.layout import Layout
from shadow.wire import frames as F
from shadow.worker.commit import agree, decode_commit, merge
from trainer_hooks.capture.stages import Stages

GROUP = {
    "lr": 0.01,
    "betas": [0.9, 0.999],
    "eps": 1e-8,
    "weight_decay": 0.1,
    "amsgrad": False,
    "maximize": False,
    "decoupled": True,
}


def _stages(param0: int, group0: int, params: int, groups: int) -> Stages:
    whole = Layout.build([(f"p{i}", (2,), i // 2, True) for i in range(4)], 2)
    return Stages(whole, [], 2, param0, group0, whole.params[param0].offset, params, groups)


def _record(skipped=(), bootstrap=False) -> dict:
    rec = {"iteration": 1, "rank": 0, "groups": [dict(GROUP)], "skipped": list(skipped), "bootstrap": bootstrap}
    if bootstrap:
        rec.update(steps=[3.0, 3.0], has_state=[True, False])
    return rec


def test_a_stage_record_speaks_for_its_part_and_the_workers_join_them():
    first, second = _stages(0, 0, 2, 1), _stages(2, 1, 2, 1)
    a, b = first.globalize(_record(bootstrap=True)), second.globalize(_record([1], bootstrap=True))
    assert a["groups"][1] is None and b["groups"][0] is None
    assert b["skipped"] == [3] and a["owns"] == [0, 2, 0, 1] and b["owns"] == [2, 4, 1, 2]
    assert b["steps"] == [0.0, 0.0, 3.0, 3.0] and b["has_state"] == [False, False, True, False]
    assert agree(a, b, 4)
    joined = merge([a, b])
    assert joined["groups"] == [GROUP, GROUP] and joined["skipped"] == [3] and "owns" not in joined
    assert joined["steps"] == [3.0, 3.0, 3.0, 3.0] and joined["has_state"] == [True, False, True, False]
    # ranks of one stage must agree on its skipped parameters; other stages' do not matter
    assert not agree(b, second.globalize(_record([0])), 4)
    assert agree(a, second.globalize(_record([0])), 4)
    # a stage nobody speaks for cannot be replayed
    with pytest.raises(ValueError, match="pipeline stage missing"):
        merge([a, a])
    # without stages, the first rank's record is the iteration's
    plain = {**_record(), "groups": [GROUP, GROUP]}
    assert merge([plain, dict(plain)]) is plain


def _decode(rec: dict) -> dict:
    rec = dict(rec, sent=0)
    h = F.Header(F.Kind.COMMIT, F.Field.GRAD, job=1, epoch=0, rank=0, world=2, layout=7, iteration=1, seq=0, runs=())
    return decode_commit(msgpack.packb({"replay": rec}, use_bin_type=True), h, 4, 2)[0]


def test_a_stage_record_claiming_what_it_does_not_own_is_malformed():
    good = _stages(2, 1, 2, 1).globalize(_record([1]))
    assert _decode(good)["owns"] == [2, 4, 1, 2]
    for bad, what in (
        (dict(good, owns=[2, 4, 1]), "owns"),
        (dict(good, owns=[3, 2, 1, 2]), "owns parameters"),
        (dict(good, owns=[2, 4, 1, 3]), "owns parameters"),
        (dict(good, skipped=[0]), "does not own"),
        (dict(good, groups=[GROUP, GROUP]), "does not own"),
    ):
        with pytest.raises(F.FrameError, match=what):
            _decode(bad)
