"""LightningModules (one per training task) that receive their network as an argument, metrics and
callbacks. The networks they train live in ``attn_zoo.models.networks``."""
from .base import Task
from .callbacks import ThroughputMonitor
from .language_model import LanguageModelTask
from .lm_esm import ESMMaskedLMTask
from .msa_distogram import MSADistogramTask

__all__ = ["Task", "MSADistogramTask", "LanguageModelTask", "ESMMaskedLMTask", "ThroughputMonitor"]
