"""`d3d bench`'s identity check: exact in float32; in bfloat16 a flip at a near-tie of the target's own logits is a
near-tie (not a failure), any other difference a divergence."""

import torch

from conftest import tiny_target
from d3d.benchmark.identity import (classify, effective_sampling, kolmogorov_smirnov_p_value, sampled_consistency,
                                     uniformity_p_value)
from d3d.common.report import markdown


def near_tie_target(dtype: torch.dtype):
    """A target whose best next token is always 5, with 7 a near-tie behind it (margin 1/160 of the top logit,
    exact in bfloat16) and every other token far behind."""
    target = tiny_target(0, vocab_size=16)
    head = torch.nn.Linear(32, 16, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[5], head.bias[7] = 10.0, 9.9375
    target.lm_head = head
    return target.to(dtype)


PROMPTS = [torch.tensor([[1, 2, 3]])] * 4
REFERENCE = [[5, 5, 5]] * 4
OUTPUTS = [[5, 5, 5], [5, 7, 5], [7, 5, 5], [5, 3, 5]]  # identical, two flips to the runner-up, a clear divergence


def test_flips_at_a_near_tie_are_near_ties_in_bfloat16_and_divergences_in_float32():
    greedy = near_tie_target(torch.bfloat16).generate(PROMPTS[0], max_new_tokens=3, do_sample=False)
    assert greedy[0, 3:].tolist() == REFERENCE[0]
    assert classify(near_tie_target(torch.bfloat16), PROMPTS, REFERENCE, OUTPUTS) == {
        "identical": 1, "near_ties": 2, "divergences": 1}
    assert classify(near_tie_target(torch.float32), PROMPTS, REFERENCE, OUTPUTS) == {
        "identical": 1, "near_ties": 0, "divergences": 3}


def test_against_another_engines_reference_a_near_tie_may_go_either_way():
    """vLLM alone's greedy output is not the target's own: where the target nearly ties, the reference may hold the
    runner-up (7) and the compared output the target's best (5); only `either_order` calls that a near-tie."""
    reference, outputs = [[7, 5, 5], [5, 5, 5]], [[5, 5, 5], [3, 5, 5]]
    target = near_tie_target(torch.bfloat16)
    assert classify(target, PROMPTS[:2], reference, outputs) == {"identical": 0, "near_ties": 0, "divergences": 2}
    assert classify(target, PROMPTS[:2], reference, outputs, either_order=True) == {
        "identical": 0, "near_ties": 1, "divergences": 1}
    assert classify(near_tie_target(torch.float32), PROMPTS[:2], reference, outputs, either_order=True) == {
        "identical": 0, "near_ties": 0, "divergences": 2}


def test_the_table_says_which_dtype_checks_identity_exactly():
    row = {"method": "D3D sync", "tokens_per_second": 1.0, "speedup": 1.0, "tau": 2.0, "hit_rate": None,
           "lossless": False, "identical_outputs": 3, "identical": 3, "near_ties": 1, "divergences": 0}
    results = {"identity": "up to near-ties", "max_new_tokens": 3, "block_size": 4, "sweep": [],
               "prompt_sets": {"set": {"prompts": 4, "methods": [row]}}}
    table = markdown(results)
    assert "| near-ties (3/4) |" in table and "float32 run checks identity exactly" in table
    row.update(divergences=1, near_ties=0)
    assert "| NO (3/4) |" in markdown(results)


def sampled(target, prompts, temperature: float, seed: int, new_tokens: int = 24) -> list[list[int]]:
    torch.manual_seed(seed)
    return [target.generate(p, do_sample=True, temperature=temperature, top_k=0, max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens)[0, p.shape[1]:].tolist() for p in prompts]


def test_sampled_outputs_are_consistent_with_the_targets_own_and_colder_ones_are_not():
    """The sampled check, per prompt (paired): another draw from the target's distribution passes; draws at a lower
    temperature than the one checked (likelier tokens) fail, as do tokens outside top-k."""
    target = tiny_target(3, vocab_size=16)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 16, (1, 4), generator=generator) for _ in range(32)]
    settings = {"do_sample": True, "temperature": 1.0, "top_k": 0}
    reference = sampled(target, prompts, 1.0, 1)
    same = sampled_consistency(target, prompts, reference, sampled(target, prompts, 1.0, 2), settings)
    colder = sampled_consistency(target, prompts, reference, sampled(target, prompts, 0.3, 3), settings)
    assert same["consistent"] and abs(same["z"]) < 4, same
    assert not colder["consistent"] and colder["z"] > 4 and colder["p"] < 1e-4, colder
    narrow = sampled_consistency(target, prompts, reference, reference, {**settings, "top_k": 2})
    assert narrow["outside_support"] > 0 and not narrow["consistent"]


def test_at_eight_prompts_the_token_level_uniformity_test_catches_what_the_paired_test_cannot():
    """The paired sign-flip test cannot reject below 14 prompts (its smallest p is 2 / 2^n); the randomised
    probability integral transforms of the tokens can: at 8 prompts, draws at a lower temperature than the one checked
    fail by them alone, and another draw from the target's own distribution passes."""
    target = tiny_target(3, vocab_size=16)
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)  # a random tiny model is near uniform: temperature would change little
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 16, (1, 4), generator=generator) for _ in range(8)]
    settings = {"do_sample": True, "temperature": 1.0, "top_k": 0}
    reference = sampled(target, prompts, 1.0, 1, new_tokens=64)
    same = sampled_consistency(target, prompts, reference, sampled(target, prompts, 1.0, 2, new_tokens=64), settings)
    colder = sampled_consistency(target, prompts, reference, sampled(target, prompts, 0.5, 3, new_tokens=64),
                                 settings)
    assert same["consistent"] and same["uniform_p"] > 1e-3, same
    assert colder["p"] >= 2 / 2**8 and colder["uniform_p"] < 1e-4 and not colder["consistent"], colder


def test_sampling_is_checked_against_what_generate_draws_with_including_its_defaults():
    """`generate(do_sample=True, temperature=1.0)` draws from the 50 likeliest tokens (transformers' default top-k)
    unless the call or the model's generation config says otherwise: checked against the whole vocabulary, the
    target's own draws failed (`d3d bench --do-sample --temperature 1.0` said NO for every method). The bench makes
    the settings `generate` would use explicit (`effective_sampling`); an explicit setting wins, then the config's."""
    target = tiny_target(3, vocab_size=256)  # near uniform: its 50 likeliest of 256 tokens are far from all of them
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (1, 4), generator=generator) for _ in range(8)]
    given = {"do_sample": True, "temperature": 1.0}

    def draws(seed: int) -> list[list[int]]:
        torch.manual_seed(seed)
        return [target.generate(p, **given, max_new_tokens=64, min_new_tokens=64)[0, p.shape[1]:].tolist()
                for p in prompts]

    effective = effective_sampling(target, given)
    assert effective == {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 50}
    reference, outputs = draws(1), draws(2)
    assert sampled_consistency(target, prompts, reference, outputs, effective)["consistent"]
    assert not sampled_consistency(target, prompts, reference, outputs, given)["consistent"]  # the old check
    target.generation_config.top_k = 20
    assert effective_sampling(target, given)["top_k"] == 20
    assert effective_sampling(target, {**given, "top_k": 5})["top_k"] == 5


def test_the_uniformity_tests_hold_their_level_on_uniform_values_and_reject_skewed_ones():
    """Under the null Kolmogorov-Smirnov gives p < 0.05 about 5 % of the time, the Bonferroni pair at most that;
    values skewed low (a power of uniforms) are rejected by both."""
    generator = torch.Generator().manual_seed(0)
    nulls = [torch.rand(200, generator=generator, dtype=torch.float64) for _ in range(400)]
    assert 0.02 < sum(kolmogorov_smirnov_p_value(v) < 0.05 for v in nulls) / len(nulls) < 0.09
    assert 0.005 < sum(uniformity_p_value(v) < 0.05 for v in nulls) / len(nulls) < 0.07
    skewed = torch.rand(1000, generator=generator, dtype=torch.float64) ** 1.3
    assert kolmogorov_smirnov_p_value(skewed) < 1e-6 and uniformity_p_value(skewed) < 1e-6


def test_in_bfloat16_a_token_just_outside_the_support_is_rounding_and_in_float32_it_is_outside():
    """With top-k 1 the support is the target's best token (5); its near-tie runner-up (7, 1/160 of the top logit
    behind) is what a bfloat16 step may keep where the checking pass ranks it second: within the rounding allowance in
    bfloat16, outside in float32. A token far behind (3) is outside in both."""
    settings = {"do_sample": True, "temperature": 1.0, "top_k": 1}
    prompts, reference = PROMPTS[:2], [[5, 5, 5], [5, 5, 5]]
    for dtype, outside in ((torch.bfloat16, 0), (torch.float32, 1)):
        check = sampled_consistency(near_tie_target(dtype), prompts, reference, [[5, 7, 5], [5, 5, 5]], settings)
        assert check["outside_support"] == outside, (dtype, check)
        far = sampled_consistency(near_tie_target(dtype), prompts, reference, [[5, 3, 5], [5, 5, 5]], settings)
        assert far["outside_support"] == 1 and not far["consistent"], (dtype, far)
