"""Operating the cluster: ``baton.v1.Admin`` and the ``baton admin`` CLI.

Owns: ``servicer`` (list workers and pools, scale, drain, plan; bearer-token guard), ``cli`` (`baton admin`),
``convert`` (admin proto conversions), ``planner`` (pool sizes from SLOs, pure math), ``profile`` and
``profile_cli`` (measuring running workers for the planner), ``traffic`` (what the router served lately, from
its histograms), ``kube`` (scaling Deployments). May import the serving core's config and
``router.generate_cli``'s helpers, ``router.routing.policy`` (its config), kv_transfer and proto.
"""
