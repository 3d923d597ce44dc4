"""What the decoding commands share: --attention-dir ends up holding exactly this run's
heatmaps, and is refused when it holds files of the user's."""

from __future__ import annotations

from pathlib import Path

from clirun import nmt, unchanged


def _names(folder: Path) -> set[str]:
    return {path.name for path in folder.iterdir()}


def _heatmaps(*indices: int) -> set[str]:
    return {f"{i:06d}{suffix}" for i in indices for suffix in (".png", ".npy", ".json")}


def test_attention_dir_holds_only_this_runs_heatmaps(run: Path, tmp_path: Path) -> None:
    """An earlier run's heatmaps go, also the one of a line that is blank now (which gets
    none), and a temporary file of a write killed midway."""
    folder = tmp_path / "attention"
    first = nmt("translate", "-m", str(run), "--attention-dir", str(folder), stdin=b"sol\nmar\na\n")
    assert first.code == 0, first.err
    assert _names(folder) == _heatmaps(0, 1, 2)
    (folder / ".000000.png.k2j4_x9a.tmp").write_bytes(b"cut short")
    again = nmt("translate", "-m", str(run), "--attention-dir", str(folder), stdin=b"\nrio\n")
    assert again.code == 0, again.err
    assert _names(folder) == _heatmaps(1)


def test_attention_dir_with_other_files_is_refused(
    run: Path, tmp_path: Path, previous: Path
) -> None:
    folder = tmp_path / "attention"
    folder.mkdir()
    (folder / "000000.png").write_bytes(b"an earlier heatmap")
    (folder / "NOTES.txt").write_text("mine\n", encoding="utf-8")
    (folder / "plots").mkdir()
    args = ["-o", str(previous), "--attention-dir", str(folder)]
    result = nmt("translate", "-m", str(run), *args, stdin=b"sol\n")
    assert result.error == (
        f"error: --attention-dir {folder}: holds files nmt did not write there (NOTES.txt, "
        f"plots); give a new or empty folder, or one of earlier heatmaps, which are replaced"
    )
    assert _names(folder) == {"000000.png", "NOTES.txt", "plots"} and unchanged(previous)
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("sol\tSOL\n", encoding="utf-8")
    scored = nmt("score", "-m", str(run), "--tsv", str(tsv), "--attention-dir", str(folder))
    assert f"--attention-dir {folder}: holds files nmt did not write there" in scored.error
