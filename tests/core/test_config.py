"""StackConfig: round trips, cross-field rules (each names its path), and a corpus of bad stack files."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from supernode.cli import main
from supernode.core.config import ConfigError, StackConfig, from_mapping, load_file, load_stack, read_stack_file

ROOT = Path(__file__).resolve().parents[2]
CORPUS = sorted((Path(__file__).parent / "invalid_stacks").glob("*.yaml"))


@pytest.fixture(scope="module")
def dev_data() -> dict:
    return read_stack_file(ROOT / "Pulumi.dev.yaml")


def mutated(data: dict, path: str, value) -> dict:
    out = copy.deepcopy(data)
    keys = path.split(".")
    node = out
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    node[int(keys[-1]) if isinstance(node, list) else keys[-1]] = value
    return out


def issue_paths(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as e:
        from_mapping(data)
    return [i.path for i in e.value.issues]


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_round_trip_through_pulumi_config_mapping(stack):
    cfg = load_stack(stack, ROOT)
    again = from_mapping(cfg.to_mapping())
    assert again == cfg
    # to_mapping emits camelCase keys, as `pulumi config set --path` writes them
    assert "acceleratorNodeGroups" in cfg.to_mapping() and "accelerator_node_groups" not in cfg.to_mapping()


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_runtime_config_reads_the_same_schema(stack):
    """`components/stack_config.py` reads Pulumi's runtime config (JSON strings) into the same StackConfig."""
    from pulumi.runtime.config import set_all_config

    from supernode.components.stack_config import stack_config
    from supernode.tools.preview import config_for_engine

    cfg = load_stack(stack, ROOT)
    set_all_config(config_for_engine(stack, cfg))
    try:
        assert stack_config() == cfg
    finally:
        set_all_config({})


def test_stack_sizes_are_realistic():
    dev, prod = load_stack("dev", ROOT), load_stack("prod", ROOT)
    assert dev.accelerators == 16 and dev.nodes == 2
    assert prod.accelerators >= 128 and all(g.instance_type == "p5.48xlarge" for g in prod.accelerator_node_groups)


RULES = [
    # (mutation path, value, expected issue path)
    ("acceleratorNodeGroups.0.nodes", 3, "supernode:parallel.dpShard"),  # world size
    ("parallel.tp", 16, "supernode:parallel.tp"),  # tp > accelerators per node
    ("model.kvHeads", 1, "supernode:parallel.tp"),  # tp must divide kv heads
    ("model.experts", 12, "supernode:parallel.ep"),  # ep must divide experts
    ("parallel.ep", 32, "supernode:parallel.ep"),  # ep must divide dp_shard*tp (and experts)
    ("training.globalBatch", 100, "supernode:training.globalBatch"),
    ("availabilityZone", "us-west-2a", "supernode:availabilityZone"),
    ("network.vpcCidr", "10.20.0.0/99", "supernode:network.vpcCidr"),
    ("network.gpuSubnetCidr", "10.20.0.0/20", "supernode:network.gpuSubnetCidr"),  # overlaps private[0]
    ("network.privateSubnetCidrs.0", "192.168.0.0/19", "supernode:network.privateSubnetCidrs[0]"),  # outside VPC
    # the per-node utilisation alarm is a Metrics Insights query: it evaluates at most 3 hours
    ("training.stallRestartS", 600, "supernode:training.stallRestartS"),  # not above collectiveTimeoutS (600)
    ("monitoring.gpuUtilWindowMinutes", 181, "supernode:monitoring.gpuUtilWindowMinutes"),
]


@pytest.mark.parametrize("path,value,expected", RULES)
def test_cross_field_rule_names_its_path(dev_data, path, value, expected):
    assert expected in issue_paths(mutated(dev_data, path, value))


def pipelined(data: dict, **parallel) -> dict:
    """The dev stack with these parallel keys (pp 2 over 16 GPUs by default); its CPU layout stays pp 1."""
    data = mutated(data, "parallel", dict(data["parallel"], **{"pp": 2, "tp": 1, "dpShard": 8, **parallel}))
    return mutated(data, "local.parallel", dict(data["local"]["parallel"], pp=1))


def test_pipeline_parallel_is_accepted_with_uneven_stages(dev_data):
    # pp > 1 used to be rejected until the trainer had a schedule; layers need not divide by pp.
    cfg = from_mapping(mutated(pipelined(dev_data), "model.layers", 7))
    assert (cfg.parallel.pp, cfg.parallel.pp_schedule, cfg.parallel.pp_virtual_stages) == (2, "1f1b", 1)
    cfg = from_mapping(pipelined(dev_data, ppSchedule="interleaved1f1b", ppVirtualStages=2, ppFirstStageFewerLayers=1))
    assert cfg.parallel.stages == 4


@pytest.mark.parametrize(
    "changes,expected",
    [
        ({"model.layers": 1, "model.firstDenseLayers": 0}, "supernode:parallel.pp"),  # 2 stages, 1 layer
        ({"parallel.ppFirstStageFewerLayers": 12}, "supernode:parallel.ppFirstStageFewerLayers"),
        ({"parallel.ppLastStageFewerLayers": 12}, "supernode:parallel.ppLastStageFewerLayers"),
        ({"training.microBatch": 16}, "supernode:training.microBatch"),  # 128 / (16 * 8) = 1 micro-batch < pp
        ({"parallel.ppVirtualStages": 2}, "supernode:parallel.ppVirtualStages"),  # needs interleaved1f1b
        ({"parallel.ppSchedule": "interleaved1f1b"}, "supernode:parallel.ppVirtualStages"),  # needs >= 2
        (
            {
                "parallel.ppSchedule": "interleaved1f1b",
                "parallel.ppVirtualStages": 2,
                "parallel.pp": 4,
                "parallel.dpShard": 4,
                "training.globalBatch": 96,
            },
            "supernode:training.microBatch",
        ),  # 6 % 4
        ({"model.tieEmbeddings": True}, "supernode:model.tieEmbeddings"),
        ({"parallel.ppSchedule": "zero-bubble"}, "supernode:parallel.ppSchedule"),
    ],
)
def test_pipeline_rules_name_their_path(dev_data, changes, expected):
    data = pipelined(dev_data)
    for path, value in changes.items():
        data = mutated(data, path, value)
    assert expected in issue_paths(data)


def test_every_problem_is_reported_at_once(dev_data):
    data = mutated(dev_data, "parallel.tp", 16)
    data = mutated(data, "training.globalBatch", 100)
    data = mutated(data, "availabilityZone", "eu-west-1a")
    paths = issue_paths(data)
    assert {"supernode:parallel.tp", "supernode:availabilityZone"} <= set(paths)


def test_error_names_value_and_valid_choice(dev_data):
    with pytest.raises(ConfigError) as e:
        from_mapping(mutated(dev_data, "acceleratorNodeGroups.0.nodes", 3))
    text = str(e.value)
    assert "24" in text and "dpShard = 12 would match" in text


def test_placement_group_defaults_off_for_reservations(dev_data):
    cap = {"type": "capacity-reservation", "reservationId": "cr-0123456789abcdef0"}
    cfg = from_mapping(mutated(dev_data, "acceleratorNodeGroups.0.capacity", cap))
    assert cfg.accelerator_node_groups[0].use_placement_group is False
    assert from_mapping(dev_data).accelerator_node_groups[0].use_placement_group is True


def test_local_config_scales_the_plan_down():
    cfg = load_stack("dev", ROOT)
    local = cfg.local_config()
    assert local.parallel.world_size == cfg.local.nproc
    assert local.model.dim < cfg.model.dim and local.model.vocab == 256
    assert local.region == cfg.region  # everything not overridden is the stack's


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 20


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
def test_invalid_stack_file_exits_2_naming_the_path(path, capsys):
    expected = path.read_text().splitlines()[0].removeprefix("# expect: ").strip()
    assert main(["plan", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert expected in err, err
    assert "Traceback" not in err


def test_missing_file_exits_2(capsys, tmp_path):
    assert main(["plan", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "stack file not found" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["malformed_yaml", "world_size_mismatch", "null_model"])
def test_real_process_prints_no_traceback(name):
    """The console script end to end: exit 2, message on stderr, no traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "supernode",
            "plan",
            "--config",
            str(Path(__file__).parent / "invalid_stacks" / f"{name}.yaml"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "invalid configuration" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan"])  # neither --stack nor --config
    assert e.value.code == 2


def test_yaml_dump_of_config_is_loadable(tmp_path):
    """What a user gets by writing `to_mapping()` back as a stack file validates again."""
    cfg = load_stack("prod", ROOT)
    doc = {"config": {f"supernode:{k}": v for k, v in cfg.to_mapping().items()}}
    f = tmp_path / "Pulumi.copy.yaml"
    f.write_text(yaml.safe_dump(doc))
    assert isinstance(from_mapping(read_stack_file(f)), StackConfig)


# -- bring your own VPC ------------------------------------------------------------------------------

BYO = {
    "existingVpcId": "vpc-0a1b2c3d4e5f60718",
    "existingPrivateSubnetIds": ["subnet-0a1b2c3d4e5f60711", "subnet-0a1b2c3d4e5f60722"],
    "existingGpuSubnetId": "subnet-0a1b2c3d4e5f60733",
}
SUBNET_CIDR_KEYS = ("privateSubnetCidrs", "publicSubnetCidrs", "gpuSubnetCidr")


def in_existing_vpc(data: dict, **network) -> dict:
    """dev in an existing VPC: subnets by id, no subnet CIDRs; `network` overrides (None removes a key)."""
    net = {k: v for k, v in data["network"].items() if k not in SUBNET_CIDR_KEYS}
    net.update(BYO)
    net.update(network)
    return mutated(data, "network", {k: v for k, v in net.items() if v is not None})


def issue_at(data: dict, path: str):
    with pytest.raises(ConfigError) as e:
        from_mapping(data)
    found = [i for i in e.value.issues if i.path == path]
    assert found, [str(i) for i in e.value.issues]
    return found[0]


def test_existing_vpc_config_loads_and_round_trips(dev_data):
    cfg = from_mapping(in_existing_vpc(dev_data))
    net = cfg.network
    assert (net.existing_vpc_id, net.existing_private_subnet_ids, net.existing_gpu_subnet_id) == (
        BYO["existingVpcId"],
        BYO["existingPrivateSubnetIds"],
        BYO["existingGpuSubnetId"],
    )
    assert (net.private_subnet_cidrs, net.public_subnet_cidrs, net.gpu_subnet_cidr) == ([], [], None)
    assert from_mapping(cfg.to_mapping()) == cfg
    assert net.nat_gateway is None and not net.use_nat_gateway  # NAT defaults off in an existing VPC


def test_nat_gateway_defaults_on_for_a_created_vpc(dev_data):
    assert "natGateway" not in dev_data["network"]
    assert from_mapping(dev_data).network.use_nat_gateway


BYO_RULES = [
    # (network overrides, issue path, what the message must say)
    (
        {"existingPrivateSubnetIds": ["subnet-0a1b2c3d4e5f60711"]},
        "network.existingPrivateSubnetIds",
        "one subnet id (subnet-...) per availability zone, in the same order (us-east-1a, us-east-1b)",
    ),
    (
        {"existingPrivateSubnetIds": ["subnet-0a1b2c3d4e5f60711"] * 2},
        "network.existingPrivateSubnetIds",
        "must be distinct",
    ),
    (
        {"existingGpuSubnetId": None},
        "network.existingGpuSubnetId",
        "required with network.existingVpcId: the id (subnet-...) of the GPU nodes' subnet in availabilityZone us-east-1a",  # noqa: E501
    ),
    ({"natGateway": True}, "network.natGateway", "the VPC owner provides egress"),
    ({"privateSubnetCidrs": ["10.20.0.0/19", "10.20.32.0/19"]}, "network.privateSubnetCidrs", "ambiguous"),
    ({"publicSubnetCidrs": ["10.20.192.0/24", "10.20.193.0/24"]}, "network.publicSubnetCidrs", "ambiguous"),
    ({"gpuSubnetCidr": "10.20.64.0/18"}, "network.gpuSubnetCidr", "ambiguous"),
    (
        {"existingPrivateSubnetIds": ["subnet-0a1b2c3d4e5f60711", "sn-12345678"]},
        "network.existingPrivateSubnetIds[1]",
        "^subnet-[0-9a-f]{8,17}$",
    ),
    ({"existingGpuSubnetId": "subnet-XYZ"}, "network.existingGpuSubnetId", "^subnet-[0-9a-f]{8,17}$"),
]


@pytest.mark.parametrize("network,path,says", BYO_RULES, ids=[f"{r[1]}-{i}" for i, r in enumerate(BYO_RULES)])
def test_existing_vpc_rule_names_path_value_and_fix(dev_data, network, path, says):
    issue = issue_at(in_existing_vpc(dev_data, **network), "supernode:" + path)
    assert says in str(issue)
    given = network.get(path.removeprefix("network.").split("[")[0])
    if given is not None and "[" not in path:
        assert f"(got {given!r})" in str(issue)


@pytest.mark.parametrize(
    "key,value",
    [
        ("existingPrivateSubnetIds", BYO["existingPrivateSubnetIds"]),
        ("existingGpuSubnetId", BYO["existingGpuSubnetId"]),
    ],
)
def test_existing_subnets_need_the_existing_vpc(dev_data, key, value):
    issue = issue_at(mutated(dev_data, f"network.{key}", value), f"supernode:network.{key}")
    assert "need network.existingVpcId" in issue.message and issue.value == value


@pytest.mark.parametrize("key", ["privateSubnetCidrs", "gpuSubnetCidr"])
def test_subnet_cidrs_are_required_for_a_created_vpc(dev_data, key):
    data = mutated(dev_data, "network", {k: v for k, v in dev_data["network"].items() if k != key})
    issue = issue_at(data, f"supernode:network.{key}")
    assert "required unless network.existingVpcId is set" in issue.message and issue.missing


# -- the configuration reference, did-you-mean, one round of errors -------------------------------


def test_configuration_reference_is_up_to_date():
    from supernode.core.config.reference import reference

    doc = ROOT / "docs" / "configuration.md"
    assert doc.read_text(encoding="utf-8") == reference() + "\n", (
        "docs/configuration.md is stale: run `supernode config reference > docs/configuration.md`"
    )
    text = reference()
    # Every key of every section is in it, with allowed values and the rules in words.
    for key in ("dpShard", "hbmHeadroom", "checkpointWriteBudgetS", "existingGpuSubnetId", "gateMinFraction"):
        assert f"| `{key}` |" in text
    assert "`none`, `selective`, `full`" in text and "one of p4d.24xlarge" in text
    assert "ep divides experts and dpShard x tp" in text


def _stack_text(**replace: str) -> str:
    text = (ROOT / "Pulumi.dev.yaml").read_text(encoding="utf-8")
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


def test_unknown_key_suggests_the_close_one(tmp_path, capsys):
    path = tmp_path / "Pulumi.t.yaml"
    path.write_text(_stack_text(**{"    dpShard:": "    dpShrad:"}), encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_file(path)
    issue = next(i for i in e.value.issues if i.path == "supernode:parallel.dpShrad")
    assert "did you mean 'dpShard'?" in issue.message and "valid keys here: activationCheckpointing" in issue.message


def test_misspelt_namespace_is_reported_not_ignored(tmp_path):
    path = tmp_path / "Pulumi.t.yaml"
    path.write_text(_stack_text() + "  supernod:monitoring:\n    logRetentionDays: 7\n", encoding="utf-8")
    with pytest.raises(ConfigError) as e:
        load_file(path)
    assert [i.path for i in e.value.issues] == ["config.supernod:monitoring"]
    assert "did you mean 'supernode' (supernode:monitoring)" in e.value.issues[0].message
    # Other namespaces (aws:, kubernetes:, a team's own) are left alone.
    path.write_text(_stack_text() + "  myteam:owner: ml-platform\n", encoding="utf-8")
    assert load_file(path).region


def test_field_and_cross_field_errors_come_in_one_round(tmp_path):
    path = tmp_path / "Pulumi.t.yaml"
    path.write_text(
        _stack_text(**{"    dpShard:": "    dpShrad:", "vpcCidr: 10.20.0.0/16": "vpcCidr: 10.20.0.0/33"}),
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as e:
        load_file(path)
    paths = [i.path for i in e.value.issues]
    assert "supernode:parallel.dpShrad" in paths  # the schema's finding
    assert "supernode:network.vpcCidr" in paths  # a cross-field rule over a section that passed the schema
    # Rules over the failed section do not run on made-up defaults (no world-size complaint about dpShard 1).
    assert "supernode:parallel.dpShard" not in paths


def test_a_suggestion_copied_into_the_stack_keeps_the_local_run_valid(tmp_path):
    """The local layout does not inherit the cluster's mesh degrees (a 128-GPU layout never fits 2
    CPU processes): copying a planner suggestion into `parallel` must not break `local`."""
    doc = yaml.safe_load((ROOT / "Pulumi.prod.yaml").read_text())
    par = doc["config"]["supernode:parallel"]
    par.update(dpReplicate=1, dpShard=16, tp=2, ep=8, pp=4, ppSchedule="interleaved1f1b", ppVirtualStages=2)
    del doc["config"]["supernode:local"]["parallel"]
    path = tmp_path / "Pulumi.copied.yaml"
    path.write_text(yaml.safe_dump(doc))
    cfg = load_file(path)
    local = cfg.local_config().parallel
    assert (local.dp_replicate, local.dp_shard, local.tp, local.ep, local.pp) == (1, cfg.local.nproc, 1, 1, 1)
    assert local.activation_checkpointing == cfg.parallel.activation_checkpointing  # the rest is inherited


def test_a_pipe_or_an_oversized_file_as_the_stack_file_is_refused(tmp_path, capsys, monkeypatch):
    """Issue 30 #10: a FIFO blocked for ever; a 100 MB stack file was read and accepted."""
    import os

    from supernode.core.config import loading

    fifo = tmp_path / "Pulumi.fifo.yaml"
    os.mkfifo(fifo)
    assert main(["plan", "--config", str(fifo)]) == 2
    assert "is not a regular file" in capsys.readouterr().err
    big = tmp_path / "Pulumi.big.yaml"
    big.write_text((ROOT / "Pulumi.dev.yaml").read_text() + "#" * 2_000)
    monkeypatch.setattr(loading, "MAX_STACK_FILE_BYTES", 1_000)
    assert main(["plan", "--config", str(big)]) == 2
    assert "over the 1,000-byte limit for this file" in capsys.readouterr().err
