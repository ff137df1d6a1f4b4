"""supernode's CrossGuard policy pack: the deployment checklist as pulumi-policy policies.

`supernode.policies.pack.POLICIES` is the list `policies/__main__.py` serves to the Pulumi CLI and that
`supernode.tools.policycheck` runs in-process; the policies live in `checklist` (items 1-9) and
`security` (item 10), reading the resources and the Plan (from the plan ConfigMap).
"""
