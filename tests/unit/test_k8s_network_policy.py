"""deploy/k8s's NetworkPolicy, rendered from each overlay: the frontend's gateway listener, which serves the
node's control surface, is reachable from the gateway's Pods alone."""

from __future__ import annotations

from tests.unit.k8s_rendering import Rendered


def opens(rules: list[dict], port: int) -> bool:
    """Whether one of these NetworkPolicy ingress rules names port (alone, or in a range to endPort)."""
    return any(p["port"] <= port <= p.get("endPort", p["port"]) for rule in rules for p in rule["ports"])


def test_only_the_gateways_pods_reach_the_frontends_gateway_listener(rendered: Rendered) -> None:
    """The listener SMG discovers serves the node's control surface (every client's cached prompts as KV
    events, flushes, aborts by id): the NetworkPolicy opens it to the gateway's Pods alone, and the public
    port and the metrics to the cluster."""
    policy = rendered.one("NetworkPolicy", "pagedserve-node")["spec"]
    node, gateway = rendered.pod("node"), rendered.pod("gateway")
    assert policy["podSelector"]["matchLabels"].items() <= node["metadata"]["labels"].items()
    assert policy["policyTypes"] == ["Ingress"]  # what no rule admits is refused
    frontend = rendered.node["frontend"]
    public = int(rendered.flags(frontend)["--address"][0].rsplit(":", 1)[1])
    listener = int(rendered.flags(frontend)["--gateway-address"][0].rsplit(":", 1)[1])
    anyone = [rule for rule in policy["ingress"] if "from" not in rule]
    assert opens(anyone, public) and not opens(anyone, listener)
    metrics = [p["containerPort"] for c in rendered.node.values() for p in c.get("ports", [])]
    assert all(opens(anyone, port) for port in metrics if port not in (public, listener)), metrics
    (gated,) = [rule for rule in policy["ingress"] if "from" in rule]
    assert [p["port"] for p in gated["ports"]] == [listener]
    (source,) = gated["from"]
    assert set(source) == {"podSelector"}  # Pods of this namespace, not a namespaceSelector or an ipBlock
    assert source["podSelector"]["matchLabels"].items() <= gateway["metadata"]["labels"].items()
    assert not source["podSelector"]["matchLabels"].items() <= node["metadata"]["labels"].items()
