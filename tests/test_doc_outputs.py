"""Every marked output block in README.md and docs/ is what its producer prints today (`tests/doc_outputs.py`; rewrite
them with `python tests/doc_outputs.py`), and the docs' numbers have one source"""
import re
from pathlib import Path

import pytest

import doc_outputs as D

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = D.blocks()

def test_every_producer_has_its_block():
    assert sorted({n for _,n,_ in BLOCKS}) == sorted(D.PRODUCERS)
    assert all(t.strip() for _,_,t in BLOCKS), 'an empty output block: run `python tests/doc_outputs.py`'

@pytest.mark.parametrize('page,name,shown', BLOCKS, ids=[n for _,n,_ in BLOCKS])
def test_the_block_is_what_the_code_prints(page, name, shown, request, one_thread):
    if name == 'job_check': request.getfixturevalue('cache')   # the job's pretrained checkpoint, in the session's cache
    diff = D.differences(shown, D.PRODUCERS[name]())
    assert not diff, f'{page.name}: the `{name}` block is stale (`python tests/doc_outputs.py {name}`):\n' + '\n'.join(diff)

def test_the_comparison_reads_the_digits_shown():
    "The README's stale block (9.9e-01 where the quickstart printed 9.4e-01) fails; a rounding boundary does not; names are text"
    assert D.differences('worst 0.bias 9.9e-01\n', 'worst 0.bias 9.4e-01\n')
    assert not D.differences('error 1.39e-01\n', 'error 1.40e-01\n')   # one unit of the last digit shown
    assert not D.differences('accuracy 0.9665\n', 'accuracy 0.9665\n')
    assert D.differences('accuracy 0.9665\n', 'accuracy 0.9721\n')
    assert D.differences('8 of 4+4 items\n', '9 of 4+4 items\n')   # whole numbers: counts, exactly
    assert D.differences('layers.1.bn2.bias 5.1e-01\n', 'layers.0.bn2.bias 5.1e-01\n')   # the digits of a name are text
    assert D.differences('NOT exact\n', 'exact\n')

def test_ties_may_come_in_either_order():
    "Two tensors tied to the digits shown may print in the other order on another CPU; a change of order that is no tie fails"
    shown = 'worst tensors     a.bias 5.1e-01, b.bias 5.1e-01, c.weight 4.5e-01\n'
    assert not D.differences(shown, 'worst tensors     b.bias 5.1e-01, a.bias 5.1e-01, c.weight 4.5e-01\n')
    assert not D.differences(shown, 'worst tensors     b.bias 5.2e-01, a.bias 5.1e-01, c.weight 4.5e-01\n')   # one unit
    assert D.differences(shown, 'worst tensors     c.weight 4.5e-01, a.bias 5.1e-01, b.bias 5.1e-01\n')   # not a tie
    assert D.differences(shown, 'worst tensors     b.bias 5.4e-01, a.bias 5.1e-01, c.weight 4.5e-01\n')
    assert D.differences(shown, 'worst tensors     a.bias 5.1e-01, d.bias 5.1e-01, c.weight 4.5e-01\n')   # another name

# -- one source for the measured figures --------------------------------------------------------------------------------
def _numbers(text:str)->set: return set(re.findall(r'(?<![\w.])\d+\.\d+(?![\w])', text))

def test_the_readme_quotes_the_benchmarks_as_bench_md_records_them():
    """The README's measured guarantees that come from a benchmark script quote docs/bench.md (the one source of the
    timings, with their date and machine): every such number is found there"""
    readme,bench = (ROOT/'README.md').read_text(),(ROOT/'docs'/'bench.md').read_text()
    table = readme[readme.index('## What it guarantees'):readme.index('## Several GPUs')]
    rows = [l for l in table.splitlines() if l.startswith('| ') and '`bench/' in l]
    assert len(rows) >= 3
    missing = {n for l in rows for n in _numbers(l.split(' | ')[1]) if n not in bench}
    assert not missing, f'README figures not in docs/bench.md: {sorted(missing)}'

@pytest.mark.parametrize('page', ['distributed.md', 'check.md', 'noise_scale.md', 'batchnorm.md'])
def test_other_pages_quote_timings_from_bench_md(page):
    "A timing a page quotes from a benchmark script ('1.8x faster', '2.38x one training window', '0.49 of the time') is bench.md's"
    text,bench = (ROOT/'docs'/page).read_text(),(ROOT/'docs'/'bench.md').read_text()
    quoted = set(re.findall(r'(?<![\w.])(\d+\.\d+)x (?:faster|slower|the time|one |plain )', text))
    quoted |= set(re.findall(r'(?<![\w.])(\d+\.\d+) of (?:the time|plain accumulation|one training)', text))
    missing = {n for n in quoted if n not in bench}
    assert not missing, f'{page}: timing figures not in docs/bench.md: {sorted(missing)}'
