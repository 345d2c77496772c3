"""The README's quickstart runs as written, offline (it makes its own `dls`), and trains as it says; what it prints is
the README's output block (`tests/test_doc_outputs.py`, which runs it once for both: `doc_outputs.run_quickstart`)"""
import doc_outputs as D

def test_quickstart_runs_offline_and_trains_as_the_readme_says(one_thread):
    code = D.quickstart_code()
    assert 'load_digits' in code and 'GradientAccumulation(n_step=8)' in code and 'check_accumulation' in code
    ns,printed = D.run_quickstart()
    learn = ns['learn']
    ga = learn.gradient_accumulation
    # 1400 training digits in micro-batches of 4, 8 per step: 43 windows of 32 and a partial one of 24 an epoch
    assert ga.steps == 88 and sorted(set(ga.window_sizes)) == [24, 32]
    assert learn.model[1].num_batches_tracked == 88   # 'pool': one running-statistics update per step
    assert 'check_accumulation' in printed and 'differs only where expected' in printed and 'cause: batchnorm' in printed
    ax = ga.plot_windows()   # returns the axes, its labels inside the figure
    assert ax.get_xlabel() == 'optimizer step' and len(ax.lines[0].get_xdata()) == 88
