import pytest

from node_host.ledger import (
    Entry,
    EntryState,
    GPULedger,
    Ledger,
    LedgerError,
    Refusal,
    Watermarks,
    mark_loaded,
    observe,
    over_high,
    release,
    reserve,
    sleep,
    wake,
    wake_candidates,
)
from sie.spec import Priority
from sie.wire import GPUInfo

P0, P1, P2 = Priority.P0, Priority.P1, Priority.P2


def entry(name, mb, *, priority=P1, state=EntryState.LOADED, measured=None, demand=0, last_used=0.0, residue=0.0):
    return Entry(
        instance_id=name,
        model_id=name,
        priority=priority,
        estimate_mb=mb,
        measured_mb=measured,
        state=state,
        demand=demand,
        last_used=last_used,
        residue_mb=residue,
    )


def ledger(*gpu_entries, total=1000.0, headroom=0.0, high=0.9, low=0.75):
    gpus = tuple(
        GPULedger(index=i, total_mb=total, headroom_mb=headroom, entries=tuple(es)) for i, es in enumerate(gpu_entries)
    )
    return Ledger(gpus=gpus, watermarks=Watermarks(high=high, low=low))


def test_from_gpus_counts_what_others_already_use_as_headroom():
    gpus = [
        GPUInfo(index=0, name="A100", total_mb=81920, used_mb=600),
        GPUInfo(index=1, name="v", total_mb=1024, used_mb=0, virtual=True),
    ]
    book = Ledger.from_gpus(gpus, reserve_mb=256, tiers={1: "gold"})
    assert [(g.headroom_mb, g.tier, g.virtual) for g in book.gpus] == [(856, None, False), (256, "gold", True)]


@pytest.mark.parametrize("high, low", [(0.9, 0.9), (0.5, 0.7), (1.1, 0.5), (0.9, 0.0)])
def test_watermarks_must_be_ordered(high, low):
    with pytest.raises(ValueError, match="0 < low < high <= 1"):
        Watermarks(high=high, low=low)


@pytest.mark.parametrize(
    "existing, headroom, gpus, size, admitted, missing",
    [
        ([], 0, [0], 900, True, None),  # exactly the high watermark (0.9 x 1000)
        ([], 0, [0], 901, False, 1),
        ([], 100, [0], 800, True, None),  # headroom counts against the watermark
        ([], 100, [0], 850, False, 50),
        ([entry("a", 500)], 0, [0], 400, True, None),
        ([entry("a", 500)], 0, [0], 450, False, 50),
        ([entry("a", 500, measured=300)], 0, [0], 600, True, None),  # the measured figure replaced the estimate
        (
            [entry("a", 500, state=EntryState.SLEEPING, residue=20)],
            0,
            [0],
            880,
            True,
            None,
        ),  # sleepers hold residue only
        ([entry("a", 500, state=EntryState.SLEEPING, residue=20)], 0, [0], 881, False, 1),
    ],
)
def test_reserve_admits_within_the_high_watermark(existing, headroom, gpus, size, admitted, missing):
    book = ledger(existing, headroom=headroom)
    out = reserve(book, gpus, entry("new", size))
    if admitted:
        assert isinstance(out, Ledger)
        assert out.gpu(0).entry("new").state is EntryState.LOADING
    else:
        assert isinstance(out, Refusal) and out.retryable and out.status == 503
        assert [(s.gpu_index, round(s.missing_mb)) for s in out.shortfalls] == [(0, missing)]
        assert f"GPU 0 lacks {missing} MiB" in out.reason
        assert out == reserve(book, gpus, entry("new", size))  # pure: same inputs, same answer
        assert book.gpu(0).entry("new") is None


def test_reserve_across_gpus_names_each_that_falls_short():
    book = ledger([entry("a", 850)], [], [entry("b", 880)])
    out = reserve(book, [0, 1, 2], entry("tp3", 100))
    assert isinstance(out, Refusal)
    assert [(s.gpu_index, s.missing_mb) for s in out.shortfalls] == [(0, 50.0), (2, 80.0)]
    assert out.candidates == (0, 1, 2)


def test_one_load_at_a_time_per_gpu():
    book = ledger([entry("loading", 100, state=EntryState.LOADING)], [])
    refused = reserve(book, [0], entry("new", 10))
    assert isinstance(refused, Refusal) and "loading 'loading'" in refused.reason and refused.retryable
    assert isinstance(reserve(book, [1], entry("new", 10)), Ledger)  # another GPU is free to load


def test_reserve_twice_is_refused():
    book = ledger([entry("a", 10)])
    out = reserve(book, [0], entry("a", 10))
    assert isinstance(out, Refusal) and out.status == 409 and not out.retryable


def test_lifecycle_reserve_load_sleep_wake_release():
    book = reserve(ledger([]), [0], entry("m", 400))
    assert book.gpu(0).held_mb == 400
    book = mark_loaded(book, "m", 350.0)
    assert (book.gpu(0).entry("m").state, book.gpu(0).held_mb) == (EntryState.LOADED, 350)
    book = sleep(book, "m", residue_mb=30)
    assert (book.gpu(0).entry("m").state, book.gpu(0).held_mb) == (EntryState.SLEEPING, 30)
    book = wake(book, "m")
    assert (book.gpu(0).entry("m").state, book.gpu(0).held_mb) == (EntryState.LOADING, 350)
    book = mark_loaded(book, "m")  # no new figure: keeps the one measured before
    assert book.gpu(0).held_mb == 350
    assert release(book, "m").gpu(0).entries == ()


def test_wake_is_admitted_like_a_load():
    book = ledger([entry("s", 500, state=EntryState.SLEEPING, residue=50), entry("big", 500)])
    out = wake(book, "s")
    assert isinstance(out, Refusal)
    assert out.shortfalls[0].needed_mb == 450  # awake figure less the residue already held
    assert out.shortfalls[0].available_mb == 350


def test_mark_loaded_per_gpu_figures_for_tensor_parallel():
    book = reserve(ledger([], []), [0, 1], entry("tp2", 400))
    book = mark_loaded(book, "tp2", {0: 410.0, 1: 390.0})
    assert [g.entry("tp2").measured_mb for g in book.gpus] == [410, 390]


def test_observe_moves_the_figure_without_admission():
    book = ledger([entry("grows", 500)])
    book = observe(book, "grows", measured_mb=950.0, demand=7, last_used=12.5)
    e = book.gpu(0).entry("grows")
    assert (e.measured_mb, e.demand, e.last_used) == (950, 7, 12.5)
    assert over_high(book) == ((0, 50.0),)


@pytest.mark.parametrize(
    "op, state, message",
    [
        (lambda b: sleep(b, "m"), EntryState.LOADING, "it is loading, not loaded"),
        (lambda b: wake(b, "m"), EntryState.LOADED, "it is loaded, not sleeping"),
        (lambda b: mark_loaded(b, "m"), EntryState.SLEEPING, "it is sleeping, not loading"),
        (lambda b: release(b, "ghost"), EntryState.LOADED, "does not hold it"),
        (lambda b: observe(b, "ghost", demand=1), EntryState.LOADED, "does not hold it"),
    ],
)
def test_steps_out_of_order_are_errors(op, state, message):
    book = ledger([entry("m", 10, state=state)])
    with pytest.raises(LedgerError, match=message):
        op(book)


def test_operations_do_not_mutate():
    book = ledger([entry("m", 100)])
    before = book
    sleep(book, "m")
    release(book, "m")
    assert book == before and book.gpu(0).entry("m").state is EntryState.LOADED


@pytest.mark.parametrize(
    "entries, expected",
    [
        ([entry("s", 100, state=EntryState.SLEEPING)], ("s",)),  # 0 + 100 <= 750
        ([entry("a", 700), entry("s", 100, state=EntryState.SLEEPING)], ()),  # 800 > low watermark 750
        ([entry("a", 590), entry("s", 160, state=EntryState.SLEEPING, residue=20)], ("s",)),  # 590 + 20 + 140 = 750
        ([entry("a", 591), entry("s", 160, state=EntryState.SLEEPING, residue=20)], ()),
        (
            [entry("l", 100, state=EntryState.LOADING), entry("s", 10, state=EntryState.SLEEPING)],
            (),
        ),  # a load is running
        (
            [
                entry("old", 10, state=EntryState.SLEEPING, last_used=1),
                entry("new", 10, state=EntryState.SLEEPING, last_used=5),
                entry("p2busy", 10, state=EntryState.SLEEPING, priority=P2, demand=3),
                entry("p0", 10, state=EntryState.SLEEPING, priority=P0),
            ],
            ("p2busy", "p0", "new", "old"),  # demand first, then priority, then most recent
        ),
    ],
)
def test_wake_candidates_stay_under_the_low_watermark(entries, expected):
    assert wake_candidates(ledger(entries)) == expected


def test_over_high_lists_each_gpu_above_it():
    book = ledger([entry("a", 950)], [entry("b", 100)], [entry("c", 901)])
    assert over_high(book) == ((0, 50.0), (2, 1.0))
