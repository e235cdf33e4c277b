"""Speculative decoding on every layer kind (DESIGN.md §3.4): drafters (prompt lookup, a draft
model, a checkpoint's MTP head, the Gemma 4 assistant), verification of a draft in one target
forward with restore points on every cache, greedy / rejection-sampling acceptance, commit of the
accepted prefix, and adaptive depth."""

from hybridlm.speculative.assistant import Assistant, AssistantDrafter
from hybridlm.speculative.base import Draft, Drafter, HiddenStateDrafter, TargetCacheDrafter, TargetPolicy
from hybridlm.speculative.controller import DepthController, StepShare
from hybridlm.speculative.draft import DraftModel, DraftModelDrafter, load_draft
from hybridlm.speculative.mtp import MTP, MTPDrafter
from hybridlm.speculative.ngram import NgramDrafter
from hybridlm.speculative.speculator import RequestSpeculation, SpeculationCounts, Speculator
from hybridlm.speculative.verify import VerifyResult, VerifyRows, commit_caches, verify_and_commit

__all__ = [
    "Assistant",
    "AssistantDrafter",
    "DepthController",
    "Draft",
    "DraftModel",
    "DraftModelDrafter",
    "Drafter",
    "HiddenStateDrafter",
    "MTP",
    "MTPDrafter",
    "NgramDrafter",
    "RequestSpeculation",
    "SpeculationCounts",
    "Speculator",
    "TargetCacheDrafter",
    "StepShare",
    "TargetPolicy",
    "VerifyResult",
    "VerifyRows",
    "commit_caches",
    "load_draft",
    "verify_and_commit",
]
