"""Assembles the live pool: model, device pool, weights, cost model, engine and HTTP app.

`build_app(ServerConfig, devices)` is what `python -m serving.main` runs (and what the
end-to-end tests run in-process). The model is the built-in config with seeded random weights
(`tiny` by default) or a local Hugging Face checkpoint directory; nothing is downloaded.
Weights are placed once, one replica per device (`mesh.ParamReplicas`); every worker, and every
worker that a later split or merge creates, re-wraps those buffers.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

from serving.policy.controller import initial_composition
from serving.policy.cost_model import PrefillCostModel
from serving.engine import Engine, EngineConfig
from serving.policy.plugins import router_from_spec
from serving.policy.profiles import read_profile_csv
from serving.policy.request import prompt_block_hashes
from serving.tokenizer import load_tokenizer
from serving.policy.worker import WorkerSpec
from serving.policy.checks import is_power_of_two

# Measured with `python -m vertumnus_jax.profile --model=tiny --cpu_devices=8` on the project's
# 2-core CI machine (serving/data/README.md); the router's estimates for the built-in model.
DEFAULT_PROFILE = os.path.join(os.path.dirname(__file__), "data", "tiny_cpu8.csv")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """What the serving binary's flags set (see `serving.main` for each flag's meaning).

    Attributes:
      model: a named config with seeded random weights (`vertumnus_jax.ModelConfig.named`).
      checkpoint: a local HF checkpoint directory (overrides `model`), or None.
      seed: seed of the random weights.
      composition: CP degrees in device order, or None for `auto` (from expected demand).
      degrees: CP degrees the pool may use (auto composition and the controller's range).
      expected_rate, expected_input_len: historical demand for `auto` (req/s, tokens).
      profile: prefill profile CSV the router's cost model is fitted on (None: the built-in
        CPU profile of the tiny model).
      engine: `EngineConfig`.
      api_key, admin_api_key: bearer keys (None: open / admin disabled).
      shutdown_timeout: seconds to wait for in-flight prefills at shutdown (None: no limit).
      body_timeout: seconds a request body may take to arrive after its headers (408 after).
      interpret: Pallas interpret mode (None: exactly on CPU).
      router: None for `VertumnusRouter(beta, lam)`, or "module:Class" naming a router class
        (`serving.policy.plugins.router_from_spec`), the same plug-ins `eval.replay` takes.
      served_model_names: names the API serves the model under (empty: the model's name).
      min_bucket: smallest padded length of a prefill's uncached tokens (a power of two);
        fewer distinct lengths mean fewer compilations.
    """

    model: str = "tiny"
    checkpoint: str | None = None
    seed: int = 0
    composition: tuple[int, ...] | None = None
    degrees: tuple[int, ...] = (1, 2, 4, 8)
    expected_rate: float = 4.0
    expected_input_len: int = 512
    profile: str | None = None
    engine: EngineConfig = EngineConfig()
    api_key: str | None = None
    admin_api_key: str | None = None
    shutdown_timeout: float | None = None
    body_timeout: float = 30.0
    interpret: bool | None = None
    min_bucket: int = 16
    router: str | None = None
    served_model_names: tuple[str, ...] = ()


def usable_degrees(config: ServerConfig, num_devices: int) -> list[int]:
    """`config.degrees` that fit `num_devices` devices, sorted (larger ones are dropped).

    Raises:
      ValueError: a degree that is not a power of two >= 1, or none that fits.
    """
    bad = [c for c in config.degrees if not is_power_of_two(c)]
    if bad:
        raise ValueError(f"degrees must be powers of two >= 1, got {list(config.degrees)}")
    degrees = sorted({c for c in config.degrees if c <= num_devices})
    if not degrees:
        raise ValueError(f"no degree of {list(config.degrees)} fits num_devices={num_devices}")
    return degrees


def choose_composition(config: ServerConfig, num_devices: int, degrees: Sequence[int],
                       cost_model: PrefillCostModel) -> list[int]:
    """The initial composition: `config.composition`, or the paper's rule on expected demand.

    Args:
      config: the server's configuration.
      num_devices: devices of the pool.
      degrees: the usable CP degrees, sorted (`usable_degrees(config, num_devices)`).
      cost_model: the fitted prefill cost model (capacity per degree).

    Raises:
      ValueError: a composition that does not fill `num_devices` devices with powers of two in
        `config.degrees`, or degrees the cost model has no profile for.
    """
    degrees = list(degrees)
    if not (math.isfinite(config.expected_rate) and config.expected_rate > 0):
        raise ValueError(f"expected_rate must be a finite number > 0 req/s, got "
                         f"{config.expected_rate}")
    missing = [c for c in degrees if c not in cost_model.degrees]
    if missing:
        raise ValueError(f"degrees {missing} have no prefill profile (profile has "
                         f"{list(cost_model.degrees)}); pass --profile or fewer --degrees")
    if config.composition is not None:
        comp = list(config.composition)
        if sum(comp) != num_devices or any(c not in degrees for c in comp):
            raise ValueError(f"composition {comp} must use degrees in {degrees} and sum to "
                             f"num_devices={num_devices}")
        return comp
    ctl = config.engine.controller_config
    return initial_composition(
        num_devices, degrees, config.expected_rate,
        lambda c: cost_model.predict(c, config.expected_input_len, 0), ctl.upper)


def fit_cost_model(config: ServerConfig) -> PrefillCostModel:
    """The router's cost model, fitted to `config.profile` (default: the built-in CPU one)."""
    return PrefillCostModel.fit(read_profile_csv(config.profile or DEFAULT_PROFILE))


def assemble_engine(config: ServerConfig, make_backend, specs: Sequence[WorkerSpec],
                    cost_model: PrefillCostModel, num_devices: int,
                    degrees: Sequence[int], kv_bytes_per_token: int = 0) -> Engine:
    """The `Engine` over `make_backend`'s backend and `specs` (one or several hosts): the
    controller's degree range set to `degrees`, prompts hashed per full block, `config.router`
    or the default router (`kv_bytes_per_token`: the served model's, for prefix fetches)."""
    ecfg = config.engine
    ctl = dataclasses.replace(ecfg.controller_config, min_degree=degrees[0],
                              max_degree=degrees[-1])
    ecfg = dataclasses.replace(ecfg, controller_config=ctl)
    bs = ecfg.block_size

    def hash_prompt(token_ids):
        return prompt_block_hashes(token_ids, bs)  # full blocks: the workers' cache keys

    router = router_from_spec(config.router) if config.router else None
    return Engine(ecfg, make_backend, specs, cost_model, num_devices, hash_prompt,
                  router=router, degrees=degrees, kv_bytes_per_token=kv_bytes_per_token)


def _model_name(config: ServerConfig) -> str:
    if config.checkpoint is not None:
        return os.path.basename(os.path.normpath(config.checkpoint))
    return config.model


def build_engine(config: ServerConfig, devices: Sequence):
    """The engine, tokenizer, model name and vocabulary size for `config` on `devices`.

    Imports jax here (not at module import) so the policy-only modules stay jax-free.

    Raises:
      ValueError / FileNotFoundError: a bad composition, profile, model name or checkpoint.
    """
    from flax import nnx

    from mesh import DevicePool, ParamReplicas
    from serving.live_backend import LiveBackend
    from vertumnus_jax import ModelConfig, init_model, load_hf_checkpoint

    ecfg = config.engine
    if config.checkpoint is not None:
        model = load_hf_checkpoint(config.checkpoint)
    else:
        model = init_model(ModelConfig.named(config.model), seed=config.seed)
    vocab, kv_bytes = model.config.vocab_size, model.config.kv_bytes_per_token
    tokenizer = load_tokenizer(config.checkpoint, vocab)
    cost_model = fit_cost_model(config)
    degrees = usable_degrees(config, len(devices))
    composition = choose_composition(config, len(devices), degrees, cost_model)
    pool = DevicePool(list(devices), composition)
    graphdef, state = nnx.split(model)
    replicas = ParamReplicas(state, list(devices))
    del model, state
    specs = [WorkerSpec(g.worker_id, g.cp_degree, g.first_device,
                        ecfg.kv_blocks_per_device * g.cp_degree, ecfg.max_input_len(g.cp_degree))
             for g in pool.groups]

    def make_backend(post, clock):
        return LiveBackend(pool, replicas, graphdef, num_blocks=ecfg.kv_blocks_per_device,
                           block_size=ecfg.block_size, post=post, clock=clock,
                           interpret=config.interpret, min_bucket=config.min_bucket,
                           kv_hold_seconds=ecfg.kv_hold_seconds)

    engine = assemble_engine(config, make_backend, specs, cost_model, len(devices), degrees,
                             kv_bytes)
    return engine, tokenizer, _model_name(config), vocab


def model_info(config: ServerConfig):
    """`(name, vocab_size, tokenizer, kv_bytes_per_token)` of the served model without loading
    its weights (the head process of the multi-host pool).

    Raises:
      ValueError / FileNotFoundError: an unknown model name or an unreadable checkpoint config.
    """
    import json

    from vertumnus_jax import ModelConfig

    if config.checkpoint is not None:
        with open(os.path.join(config.checkpoint, "config.json")) as f:
            mc = ModelConfig.from_hf_config(json.load(f))
    else:
        mc = ModelConfig.named(config.model)
    return (_model_name(config), mc.vocab_size, load_tokenizer(config.checkpoint, mc.vocab_size),
            mc.kv_bytes_per_token)


def make_app(config: ServerConfig, engine, tokenizer, name: str, vocab: int):
    """The FastAPI app over a built engine, with `config`'s names, keys and limits."""
    from serving.api import create_app
    from serving.api_chat import load_chat_template
    from serving.api_hosts import add_host_routes

    app = create_app(engine, tokenizer=tokenizer, model_name=name, vocab_size=vocab,
                     served_model_names=config.served_model_names,
                     chat_template=load_chat_template(config.checkpoint),
                     api_key=config.api_key, admin_api_key=config.admin_api_key,
                     shutdown_timeout=config.shutdown_timeout,
                     body_timeout=config.body_timeout)
    add_host_routes(app, engine)
    return app


def build_app(config: ServerConfig, devices: Sequence):
    """The FastAPI app serving `config` on `devices` (started by its lifespan)."""
    engine, tokenizer, name, vocab = build_engine(config, devices)
    return make_app(config, engine, tokenizer, name, vocab)
