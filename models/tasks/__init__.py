"""LightningModules (one per training task) that receive their network as an argument, the
networks they train, metrics and callbacks."""
from .base import Task
from .callbacks import ThroughputMonitor
from .language_model import LanguageModelTask
from .msa_distogram import MSADistogramTask
from .networks import MSADistogramNet, PairformerTrunk

__all__ = ["Task", "MSADistogramTask", "LanguageModelTask", "MSADistogramNet", "PairformerTrunk", "ThroughputMonitor"]
