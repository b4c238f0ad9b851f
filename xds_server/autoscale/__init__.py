"""The autoscaler (DESIGN §11): a model's replica count follows its demand within [min, max].

    policy.py  the decision, pure: demand in, the desired count and why out (table-tested)
    driver.py  the thin loop beside the control loop: observe the registry, decide, apply

Scale-up happens on the next decision (within a second or two); scale-down only to the largest count
recommended over the stabilisation window, and by drain: the registry's placement keeps the instances
closest to serving (ready first, placement rule 1) and drops the rest, whose node hosts stop them with
SIGTERM (their sidecars drain first), so a scale-down never stops a ready instance while one that is not
ready stays.
"""

from xds_server.autoscale.policy import Demand, ScaleDecision, ScaleState, decide

__all__ = ["Demand", "ScaleDecision", "ScaleState", "decide"]
