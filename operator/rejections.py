"""Why a DecodeService, or one candidate layout for it, is not served as asked: the kinds, as data.

Code that tells rejections apart compares these kinds, never message texts (which carry figures and
may be reworded). A :class:`ServiceRejection`'s value is the reason its conditions and Warning Event
carry, part of the API (``kubectl get events --field-selector reason=DoesNotFit``). A
:class:`LayoutRejection` stays inside the planner: the status lists each alternative with its message.
"""

from __future__ import annotations

import enum


class ServiceRejection(enum.StrEnum):
    """Why a DecodeService is not (wholly) planned; the value is the condition and Event reason."""

    INVALID_MODEL = "InvalidModel"  # the spec's model shape cannot be read (no plan is attempted)
    NO_GPU_NODES = "NoGPUNodes"  # no Ready, schedulable GPU node matches the nodeSelector and tolerations
    DOES_NOT_FIT = "DoesNotFit"  # no layout fits the eligible GPUs, even empty
    INSUFFICIENT_CAPACITY = "InsufficientCapacity"  # a layout fits; the free GPUs cannot take every replica


class LayoutRejection(enum.Enum):
    """Why the planner left a candidate layout out (a rejected ``Alternative``'s kind)."""

    # The layout cannot serve the model on these nodes.
    HEADS_DO_NOT_SPLIT = enum.auto()  # attention heads / KV heads do not divide by tp
    NODE_TOO_SMALL = enum.auto()  # tp exceeds the GPUs of one NVSwitch domain (one node)
    NEEDS_NVSWITCH = enum.auto()  # a pinned one-shot/two-shot all-reduce on nodes without NVSwitch
    WEIGHTS_TOO_LARGE = enum.auto()  # the weights alone exceed the usable memory per GPU
    NO_KV_ROOM = enum.auto()  # no room for one sequence's KV cache after the weights
    GROUP_NEVER_FITS = enum.auto()  # a pipeline group does not fit the nodes even when they are empty
    NO_ALLREDUCE_FIGURE = enum.auto()  # the calibration has no all-reduce figure for the message size
    # The layout fits, but the chosen one is better.
    SHORT_OF_REPLICAS = enum.auto()  # fewer replicas can be placed than were asked for
    SLO_NOT_MET = enum.auto()  # misses the SLO that the chosen layout meets
    RANKED_LOWER = enum.auto()  # worse by the objective's measure
