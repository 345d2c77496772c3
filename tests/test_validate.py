"`accum_callback.core.args`: the one rule for counts and switches, each refusal naming the argument and what to give"
import pytest
from accum_callback.core.args import NotWholeNumber, flag, whole_number

@pytest.mark.parametrize('v,lo,ok', [(3, 1, 3), (0, 0, 0), (2**40, 1, 2**40)])
def test_whole_numbers_in_range_pass(v, lo, ok):
    assert whole_number(v, 'n_step', lo=lo) == ok and type(whole_number(v, 'n_step', lo=lo)) is int

@pytest.mark.parametrize('v,says', [(0, r"`n_step` must be >= 1, got 0"), (2.0, r"whole number >= 1, got 2.0 \(float\)"),
                                    (True, r"got True \(bool\)"), ('4', r"got '4' \(str\)"), (None, r"got None")])
def test_other_counts_are_refused_naming_the_argument(v, says):
    with pytest.raises(NotWholeNumber, match=says) as e: whole_number(v, 'n_step')
    assert isinstance(e.value, TypeError) and isinstance(e.value, ValueError)   # caught as either

def test_where_a_count_was_given_is_said():
    with pytest.raises(NotWholeNumber, match=r"`target_bs` must be >= 1 \(value for epoch 2\), got -1"):
        whole_number(-1, 'target_bs', ' (value for epoch 2)')

def test_flags_are_true_or_false_only():
    assert flag(True, 'probe') is True and flag(False, 'probe') is False
    for v in (0, 1, 'yes', None):
        with pytest.raises(TypeError, match=r"`probe` must be True or False"): flag(v, 'probe')
