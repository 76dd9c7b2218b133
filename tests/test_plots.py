"""The plots a learner reads show what they claim to: no line hidden under another."""
import pytest

from helpers.calc import comm
from helpers.notebook import plots


def _sweep(world_size):
    rows = []
    for i, size in enumerate((4096, 65536, 1 << 20)):
        algbw, busbw = comm.bus_bandwidth(size_bytes=size, seconds=1e-3 * (i + 1), world_size=world_size)
        rows.append({"kind": "step", "rank": 0, "step": i + 1, "size_bytes": size,
                     "algbw_gbs": algbw / 1e9, "busbw_gbs": busbw / 1e9})
    return rows


@pytest.mark.parametrize("world_size, lines", [(2, 1), (4, 2), (8, 2)])
def test_bandwidth_plot_draws_one_line_where_busbw_equals_algbw(world_size, lines):
    fig = plots.bandwidth(_sweep(world_size))
    ax = fig.axes[0]
    assert len(ax.get_lines()) == lines
    if lines == 1:
        assert "algbw = busbw" in ax.get_legend().get_texts()[0].get_text()
