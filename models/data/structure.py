"""mmCIF structures through biotite: sequence, C-beta coordinates and distogram targets.

``read_mmcif`` returns one protein chain; ``distogram_bins`` turns its C-beta (C-alpha for glycine)
coordinates into AlphaFold2's 64 distance bins. Malformed files raise
``ValueError("<file>:<line>: ...")``: biotite's own errors do not carry a line, so on failure a
small scan of the ``_atom_site`` loop finds the offending row.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .alphabet import THREE_TO_ONE

# AlphaFold2 distogram: 64 bins, edges 2.3125 .. 21.6875 Angstrom (supplement 1.9.8).
DISTOGRAM_EDGES = torch.linspace(2.3125, 21.6875, 63, device="cpu")
NUM_DISTOGRAM_BINS = 64
CONTACT_CUTOFF = 8.0  # Angstrom between C-beta atoms


@dataclass
class Structure:
    """One protein chain: ``sequence`` (length N), ``coords`` ``[N, 3]`` float32 C-beta (C-alpha for
    Gly) positions in Angstrom, ``mask`` ``[N]`` bool (False where that atom is not resolved),
    ``residue_index`` ``[N]`` long: the author residue numbers, so gaps of unresolved residues keep
    their true sequence separation."""

    name: str
    chain: str
    sequence: str
    coords: torch.Tensor
    mask: torch.Tensor
    residue_index: torch.Tensor


def distogram_bins(coords: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bin pairwise distances.

    coords ``[*, N, 3]``, mask ``[*, N]`` bool -> (bins ``[*, N, N]`` long in [0, 64), pair_mask
    ``[*, N, N]`` bool, True where both atoms are resolved).
    """
    dist = torch.cdist(coords.float(), coords.float())  # [*, N, N]
    bins = torch.bucketize(dist, DISTOGRAM_EDGES.to(coords.device))
    pair_mask = mask[..., :, None] & mask[..., None, :]
    return bins, pair_mask


def _tokens(line: str) -> list[str]:
    try:
        return shlex.split(line, posix=True)
    except ValueError:
        return line.split()


def locate_atom_site_error(path: Path) -> str:
    """Find the first malformed ``_atom_site`` row: '<file>:<line>: <reason>' (or a file-level reason)."""
    from .sources import read_text

    lines = read_text(path).splitlines()
    columns: list[str] = []
    in_loop = reading_header = False
    for lineno, line in enumerate(lines, start=1):
        s = line.strip()
        if s == "loop_":
            in_loop, reading_header, columns = True, True, []
            continue
        if in_loop and reading_header and s.startswith("_"):
            columns.append(s.split()[0])
            continue
        if in_loop and reading_header:
            reading_header = False
            if not any(c.startswith("_atom_site.") for c in columns):
                in_loop = False
                continue
        if not in_loop:
            continue
        if s.startswith("#") or s.startswith("_") or s.startswith("data_") or s == "":
            in_loop = False
            continue
        values = _tokens(s)
        if len(values) != len(columns):
            return f"{path}:{lineno}: _atom_site row has {len(values)} values, the loop declares {len(columns)} columns"
        for name in ("_atom_site.Cartn_x", "_atom_site.Cartn_y", "_atom_site.Cartn_z"):
            if name in columns:
                v = values[columns.index(name)]
                try:
                    float(v)
                except ValueError:
                    return f"{path}:{lineno}: {name} is {v!r}, not a number"
    if not any(l.strip().startswith("_atom_site.") for l in lines):
        return f"{path}:1: no _atom_site category (no atom coordinates) in mmCIF file"
    return f"{path}:1: malformed mmCIF file"


def check_complete(text: str, path: Path) -> None:
    """Raise ValueError if an mmCIF file looks truncated: it closes its categories with '#' lines (as
    the PDB's and gemmi's files do) but its final record is not one, i.e. it ends inside a category."""
    lines = text.rstrip("\n").split("\n")
    if not any(line.strip() == "#" for line in lines) or lines[-1].strip() == "#":
        return
    category = next((line.split(".")[0].split()[0] for line in reversed(lines) if line.startswith("_")), "a category")
    raise ValueError(
        f"{path}:{len(lines)}: the file ends inside {category} without the closing '#' record that ends its other "
        f"categories: it looks truncated (download or copy it again)"
    )


def read_mmcif(path: str | Path, chain: str | None = None, min_residues: int = 16) -> Structure:
    """Read the first model of an mmCIF file and return one protein chain.

    ``chain``: author chain id; default = the longest amino-acid chain with >= ``min_residues``
    residues. Residues are those present in ``_atom_site`` (unresolved ones are skipped). ``.cif.gz``
    is read too; a file cut short (no closing '#' record) is refused (``check_complete``).
    """
    import biotite.structure as struc
    import biotite.structure.io.pdbx as pdbx

    import io

    from .sources import protein_name, read_text

    path = Path(path)
    text = read_text(path)  # .cif.gz too
    check_complete(text, path)
    try:
        atoms = pdbx.get_structure(pdbx.CIFFile.read(io.StringIO(text)), model=1)
    except Exception as err:  # biotite raises several types without a line number
        raise ValueError(f"{locate_atom_site_error(path)} (biotite: {type(err).__name__}: {err})") from err
    if not np.all(np.isfinite(atoms.coord)):
        raise ValueError(locate_atom_site_error(path) + " (non-finite coordinates)")
    # amino acids, including modified ones stored as HETATM (selenomethionine, MSE)
    atoms = atoms[struc.filter_amino_acids(atoms)]
    chains = {}
    for c in np.unique(atoms.chain_id):
        chains[str(c)] = atoms[atoms.chain_id == c]
    if chain is None:
        sizes = {c: struc.get_residue_count(a) for c, a in chains.items()}
        good = [c for c in sorted(sizes) if sizes[c] >= min_residues]
        if not good:
            raise ValueError(f"{path}:1: no protein chain with >= {min_residues} resolved residues (chains: {sizes})")
        chain = max(good, key=lambda c: sizes[c])
    if chain not in chains:
        raise ValueError(f"{path}:1: chain {chain!r} not found; protein chains: {sorted(chains)}")
    a = chains[chain]
    starts = struc.get_residue_starts(a)
    ends = list(starts[1:]) + [a.array_length()]
    seq, coords, mask, res_ids = [], [], [], []
    for s, e in zip(starts, ends):
        res = a[s:e]
        res_ids.append(int(res.res_id[0]))
        name = str(res.res_name[0])
        seq.append(THREE_TO_ONE.get(name, "X"))
        want = "CA" if name == "GLY" else "CB"
        hit = np.nonzero(res.atom_name == want)[0]
        if len(hit) == 0 and want == "CB":  # no side chain modelled: fall back to C-alpha
            hit = np.nonzero(res.atom_name == "CA")[0]
        coords.append(res.coord[hit[0]] if len(hit) else np.zeros(3, dtype=np.float32))
        mask.append(bool(len(hit)))
    return Structure(
        name=protein_name(path, path),
        chain=chain,
        sequence="".join(seq),
        coords=torch.tensor(np.stack(coords), dtype=torch.float32),  # [N, 3]
        mask=torch.tensor(mask, dtype=torch.bool),  # [N]
        residue_index=torch.tensor(res_ids, dtype=torch.long) - res_ids[0],  # [N]
    )
