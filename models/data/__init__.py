"""Protein data: parsers (A3M, FASTA, mmCIF via biotite), tokenisation, transforms, DataModules.

The real sample in ``models/data/sample`` (with its licence files) is the default dataset: pass
``"sample"`` as a directory, or your own directory of .a3m / .fasta / .cif files.
"""
from .alphabet import VOCAB_SIZE, encode, encode_msa, decode
from .parsers import MSA, Record, read_a3m, read_fasta
from .structure import NUM_DISTOGRAM_BINS, Structure, distogram_bins, read_mmcif
from .msa import MSADataModule, MSADataset
from .lm import CausalLMDataModule, MaskedLMDataModule
from .synthetic import SyntheticLMDataModule, SyntheticMSADataModule
from .sample import SAMPLE_DIR, DataError

__all__ = [
    "VOCAB_SIZE", "encode", "encode_msa", "decode", "MSA", "Record", "read_a3m", "read_fasta",
    "NUM_DISTOGRAM_BINS", "Structure", "distogram_bins", "read_mmcif", "MSADataModule", "MSADataset",
    "MaskedLMDataModule", "CausalLMDataModule", "SyntheticMSADataModule", "SyntheticLMDataModule", "SAMPLE_DIR",
    "DataError",
]
