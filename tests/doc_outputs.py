"""Every output block the docs show is produced by the code that prints it.

In README.md and docs/*.md an output block is the fenced block or the table right after a line `<!-- output: NAME -->`; `PRODUCERS`
below make each from the repo (the README's quickstart run as written, the job's check, tables from the recorded
CSVs). `tests/test_doc_outputs.py` fails when a block differs from what its producer prints: the text exactly, every
number to the digits the block shows (one unit of its last digit apart at most: a value on a rounding boundary may
round either way on another CPU). That is a precision every machine reproduces: the blocks print two or three
significant digits of computations from fixed inputs (the job's check starts from the shipped checkpoint, not weights
each machine trains), which CPUs differ on by float32's rounding, about 1e-6 relative. The page says on which machine a
block was printed. Rewrite the blocks: `python tests/doc_outputs.py` (or `NAME ...` for some).

Outputs that depend on the machine (timings, images/s) are not marked: they are examples, shown with their date,
machine and command, once (docs/bench.md for the benchmarks)."""
from __future__ import annotations
import contextlib, functools, importlib.util, io, os, re, sys, tempfile, warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT/'README.md'] + sorted((ROOT/'docs').glob('*.md'))
MARK = re.compile(r'<!-- output: (\w+) -->\n(?:```[^\n]*\n(.*?)```|((?:\|[^\n]*\n)+))', re.S)   # a fenced block or a table
NUMBER = re.compile(r'(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])')   # not the digits of a name (layers.1, bn2)
ITEM = re.compile(r'(?<![\w.])([A-Za-z_][\w.]*) ([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)(?=, |$)', re.M)   # `name value` in a list

# -- producers ------------------------------------------------------------------------------------------------------------
def quickstart_code()->str:
    text = (ROOT/'README.md').read_text()
    section = text[text.index('## Quickstart'):]
    return re.search(r'```python\n(.*?)```', section, re.S).group(1)

@functools.lru_cache(maxsize=None)
def run_quickstart()->tuple:
    "The README's quickstart run as written (in a temporary folder, figures not shown): `(namespace, stdout)`"
    import matplotlib; matplotlib.use('Agg')
    ns,out,cwd = {},io.StringIO(),os.getcwd()
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings(), contextlib.redirect_stdout(out):
        warnings.simplefilter('ignore')
        os.chdir(d)
        try: exec(compile(quickstart_code(), 'README quickstart', 'exec'), ns)
        finally: os.chdir(cwd)
    return ns,out.getvalue()

def quickstart_check()->str:
    "What the quickstart's `print(learn.check_accumulation())` prints"
    printed = run_quickstart()[1]
    i = printed.index('check_accumulation\n')
    return printed[i:].split('\n\n')[0].rstrip('\n') + '\n'

def job_check()->str:
    "`python -m accum_callback --check-only --bn pool`: the check on the job's model and data"
    from accum_finetune.cli import main
    out = io.StringIO()
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings(), contextlib.redirect_stdout(out):
        warnings.simplefilter('ignore')
        assert main(['--check-only', '--bn', 'pool', '--device', 'cpu', '--out', str(Path(d)/'out')]) == 0   # (the block is the CPU's)
    printed = out.getvalue()
    return printed[printed.index('check_accumulation\n'):].rstrip('\n') + '\n'

def _bench(name:str):
    spec = importlib.util.spec_from_file_location(name, ROOT/'bench'/f'{name}.py')
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    return mod

def bn_precise_table()->str: "bench/bn_precise_study.py's table of the recorded runs"; return _bench('bn_precise_study').table() + '\n'

def noise_study_table()->str: "bench/noise_study.py's table of the recorded runs"; return _bench('noise_study').table() + '\n'

def bn_study_table()->str:
    "notebook 02's study (docs/assets/study_results.csv): accuracy per configuration and mode, gap to the large batch, `auto`'s pick"
    import pandas as pd
    from accum_finetune.study import summarize
    s = summarize(pd.read_csv(ROOT/'docs'/'assets'/'study_results.csv'))
    rows = ['| config | BN mode | accuracy | gap (pts) |', '|---|---|---|---|']
    for r in s.itertuples():
        ref = r.config == 'large batch'
        cfg = f'large batch {r.micro_bs} x 1' if ref else r.config
        mode = '-' if ref else (f'**{r.bn}** (auto)' if r.auto else r.bn)
        gap = f'{r.gap_pts:+.2f}' if r.gap_pts else '0.00'
        rows.append(f'| {cfg} | {mode} | {r.mean:.4f} ± {r.std:.4f} | {f"**{gap}**" if r.auto and not ref and r.micro_bs == 2 else gap} |')
    return '\n'.join(rows) + '\n'

PRODUCERS = dict(quickstart_check=quickstart_check, job_check=job_check, bn_precise_table=bn_precise_table,
                 bn_study_table=bn_study_table, noise_study_table=noise_study_table)

# -- the blocks -----------------------------------------------------------------------------------------------------------
def blocks()->list:
    "`(page, name, text)` of every marked output block"
    return [(p, m.group(1), _body(m)) for p in PAGES for m in MARK.finditer(p.read_text())]

def _body(m)->str: return m.group(2) if m.group(2) is not None else m.group(3)

def _unit(s:str)->float:
    "One unit of the last digit `s` shows"
    mant,_,exp = s.lower().partition('e')
    return 10.**(-len(mant.split('.')[1]) if '.' in mant else 0) * 10.**int(exp or 0)

def _ties_in_shown_order(shown:str, made:str)->str:
    """`made` with each line's list of `name value` items in `shown`'s order where the two list the same names and only
    ties trade places (values one unit of the digits shown apart at most): another CPU's last bits may order ties either
    way; any other change of order stays, and fails"""
    s_lines,m_lines = shown.split('\n'),made.split('\n')
    if len(s_lines) != len(m_lines): return made
    out = []
    for sl,ml in zip(s_lines, m_lines):
        s_items,m_items = ITEM.findall(sl),ITEM.findall(ml)
        value = dict(m_items)
        if len(s_items) < 2 or sorted(n for n,_ in s_items) != sorted(value) or len(value) != len(m_items): out.append(ml); continue
        ordered = [(n, value[n]) for n,_ in s_items]
        ties = all(a == b or abs(float(va) - float(vb)) <= _unit(vs)*(1 + 1e-9)
                   for (a,va),(b,vb),(_,vs) in zip(m_items, ordered, s_items))
        it = iter(ordered)
        out.append(ITEM.sub(lambda m: ' '.join(next(it)), ml) if ties else ml)
    return '\n'.join(out)

def differences(shown:str, made:str)->list:
    """Where `made` differs from `shown`: other text, another count of numbers, a whole number not the same, or a number
    with decimals off by more than one unit of the last digit shown (ties in a list of `name value` items may come in
    either order: `_ties_in_shown_order`)"""
    made = _ties_in_shown_order(shown, made)
    a,b = NUMBER.split(shown),NUMBER.split(made)
    if a != b: return [f'text differs:\n--- shown\n{shown}--- printed now\n{made}']
    out = []
    for s,m in zip(NUMBER.findall(shown), NUMBER.findall(made)):
        if not re.search(r'[.e]', s.lower()):
            if s.lstrip('+') != m.lstrip('+'): out.append(f'{s} shown, {m} printed now')
            continue
        if abs(float(s) - float(m)) > _unit(s)*(1 + 1e-9): out.append(f'{s} shown, {m} printed now')
    return out

def write(names=None):
    "Rewrite the marked blocks (all, or `names`) with what their producers print now"
    made = {}
    for p in PAGES:
        text = p.read_text()
        def sub(m):
            n = m.group(1)
            if names and n not in names: return m.group(0)
            if n not in made: made[n] = PRODUCERS[n]()
            g = 2 if m.group(2) is not None else 3
            return m.group(0)[:m.start(g)-m.start()] + made[n] + m.group(0)[m.end(g)-m.start():]
        new = MARK.sub(sub, text)
        if new != text: p.write_text(new); print(f'wrote {p.relative_to(ROOT)}')

if __name__ == '__main__': write(sys.argv[1:] or None)
