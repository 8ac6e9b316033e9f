"""Progress of long measurements when stderr is a log file or a pipe (CI, nohup)."""
from collage_tvm.measure.progress import progress_bar as _progress


def test_progress_off_a_terminal_writes_a_few_lines_not_one_per_candidate(capsys):
    bar = _progress(300, True)
    for i in range(300):
        bar.update(1)
        bar.set_postfix_str(f"measured {i}, cached 0", refresh=False)  # as Measurer.costs
    bar.close()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert 1 <= len(lines) <= 3, lines  # the first line, then one every 30 s
    assert "\r" not in err and "measuring candidates" in lines[0]


def test_progress_disabled_writes_nothing(capsys):
    bar = _progress(10, False)
    bar.update(10)
    bar.close()
    assert capsys.readouterr().err == ""
