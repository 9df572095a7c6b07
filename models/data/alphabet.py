"""Protein token alphabet: 20 amino acids, X (unknown), '-' (gap), <mask> and <pad>.

Index layout (``VOCAB_SIZE = 24``)::

    0..19  A R N D C Q E G H I L K M F P S T W Y V   (AlphaFold's restype order)
    20     X       unknown / non-standard residue (B, Z, U, O, J map here)
    21     -       gap in an alignment; also the separator between proteins in the causal-LM stream
    22     <mask>  BERT-style masked position
    23     <pad>   padding (ignored by every loss)
"""
from __future__ import annotations

import torch

AMINO_ACIDS = "ARNDCQEGHILKMFPSTWYV"
UNK, GAP, MASK, PAD = 20, 21, 22, 23
VOCAB_SIZE = 24
TOKENS = list(AMINO_ACIDS) + ["X", "-", "<mask>", "<pad>"]

# Three-letter residue names (PDB chemical components) -> one-letter codes.
THREE_TO_ONE = {
    "ALA": "A", "ARG": "R", "ASN": "N", "ASP": "D", "CYS": "C", "GLN": "Q", "GLU": "E",
    "GLY": "G", "HIS": "H", "ILE": "I", "LEU": "L", "LYS": "K", "MET": "M", "PHE": "F",
    "PRO": "P", "SER": "S", "THR": "T", "TRP": "W", "TYR": "Y", "VAL": "V", "MSE": "M",
}

_LUT = torch.full((128,), UNK, dtype=torch.long, device="cpu")
for _i, _a in enumerate(AMINO_ACIDS):
    _LUT[ord(_a)] = _i
    _LUT[ord(_a.lower())] = _i
_LUT[ord("-")] = GAP
_LUT[ord(".")] = GAP


def encode(seq: str) -> torch.Tensor:
    """Encode a one-letter sequence into a ``[L]`` long tensor (unknown letters -> X, '-'/'.' -> gap)."""
    codes = torch.tensor([min(ord(c), 127) for c in seq], dtype=torch.long)
    return _LUT[codes]


def encode_msa(rows: list[str]) -> torch.Tensor:
    """Encode aligned rows (all the same length) into a ``[S, L]`` long tensor."""
    if not rows:
        raise ValueError("encode_msa: rows is empty")
    lengths = {len(r) for r in rows}
    if len(lengths) != 1:
        raise ValueError(f"encode_msa: rows have different lengths {sorted(lengths)}")
    return torch.stack([encode(r) for r in rows])


def decode(tokens: torch.Tensor) -> str:
    """Decode a ``[L]`` token tensor back into a string (<mask> -> '#', <pad> -> '')."""
    out = []
    for t in tokens.tolist():
        out.append("#" if t == MASK else "" if t == PAD else TOKENS[t])
    return "".join(out)
