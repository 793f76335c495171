import pytest

from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.sampling_params import SamplingParams


def make(prompt=(1, 2, 3), eos=(0,), max_model_len=None, **params) -> Request:
    return Request("r", list(prompt), SamplingParams(**params), eos_token_ids=eos, max_model_len=max_model_len)


def test_fresh_request_views():
    r = make(prompt=[5, 6, 7])
    assert r.status is RequestStatus.WAITING
    assert (r.num_prompt_tokens, r.num_output_tokens, r.num_tokens) == (3, 0, 3)
    assert r.append_output_token(8) is False
    assert r.all_token_ids == [5, 6, 7, 8]
    assert r.num_tokens == 4 and r.num_output_tokens == 1
    assert not r.is_finished and r.finish_reason is None and r.stop_reason is None


def test_token_ids_slice_matches_all_token_ids():
    r = make(prompt=[1, 2, 3, 4], max_tokens=10)
    for t in (5, 6, 7):
        r.append_output_token(t)
    full = r.all_token_ids
    for start in range(len(full) + 1):
        for end in range(start, len(full) + 2):
            assert r.token_ids_slice(start, end) == full[start:end]


def test_eos_stops_with_no_stop_reason():
    r = make(eos=(9,), max_tokens=5)
    assert r.append_output_token(9) is True
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert (r.finish_reason, r.stop_reason) == ("stop", None)
    assert r.output_token_ids == [9]


def test_ignore_eos():
    r = make(eos=(9,), max_tokens=2, ignore_eos=True)
    assert r.append_output_token(9) is False
    assert r.append_output_token(9) is True
    assert r.finish_reason == "length"


def test_stop_token_id_sets_stop_reason():
    r = make(eos=(), stop_token_ids=[4, 7], max_tokens=5)
    assert r.append_output_token(3) is False
    assert r.append_output_token(7) is True
    assert (r.status, r.finish_reason, r.stop_reason) == (RequestStatus.FINISHED_STOPPED, "stop", 7)


def test_min_tokens_defers_eos_and_stop_tokens():
    r = make(eos=(9,), stop_token_ids=[4], min_tokens=3, max_tokens=6)
    assert r.append_output_token(9) is False
    assert r.append_output_token(4) is False
    assert r.append_output_token(9) is True  # the 3rd output may stop
    assert r.finish_reason == "stop"


def test_max_tokens_length():
    r = make(max_tokens=2)
    assert r.append_output_token(1) is False
    assert r.append_output_token(1) is True
    assert (r.status, r.finish_reason) == (RequestStatus.FINISHED_LENGTH, "length")


def test_eos_wins_over_length_on_the_same_token():
    r = make(eos=(9,), max_tokens=1)
    assert r.append_output_token(9) is True
    assert r.finish_reason == "stop"


def test_max_model_len_bound():
    r = make(prompt=[1, 2, 3], max_tokens=None, max_model_len=5)
    assert r.max_tokens == 2
    r = make(prompt=[1, 2, 3], max_tokens=100, max_model_len=5)
    assert r.append_output_token(1) is False
    assert r.append_output_token(1) is True
    assert r.finish_reason == "length" and r.num_tokens == 5


def test_append_after_finish_raises():
    r = make(max_tokens=1)
    r.append_output_token(1)
    with pytest.raises(RuntimeError, match="already finished"):
        r.append_output_token(1)


def test_status_finish_reasons():
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.FINISHED_ERROR.finish_reason == "error"
    assert RequestStatus.RUNNING.finish_reason is None
    assert not RequestStatus.PREEMPTED.is_finished
    assert RequestStatus.from_finish_reason("length") is RequestStatus.FINISHED_LENGTH
    with pytest.raises(ValueError, match="unknown finish_reason"):
        RequestStatus.from_finish_reason("bogus")


def test_finish_requires_finished_status():
    r = make()
    with pytest.raises(ValueError, match="not a finished status"):
        r.finish(RequestStatus.RUNNING)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(request_id=""), "request_id"),
        (dict(prompt_token_ids=[1, -2]), ">= 0"),
        (dict(sampling_params="greedy"), "SamplingParams"),
        (dict(max_model_len=0), "max_model_len"),
    ],
)
def test_validation(kwargs, match):
    args = dict(request_id="r", prompt_token_ids=[1], sampling_params=SamplingParams())
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        Request(**args)
