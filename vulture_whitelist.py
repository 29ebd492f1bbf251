# Names vulture (pyproject.toml's [tool.vulture]) finds unread that are read from outside the
# code it sees. It parses this file and never runs it. A name that is truly dead is deleted,
# not listed here.

# Python's own protocols: a module's dir(), warnings' display hook, context managers' exit
# arguments, numpy's read-only flag, nn.Module's register_buffer signature (a typing stub).
__dir__
_.showwarning
tb
exc
_.writeable
persistent

# TransformerLens's and Hugging Face's surface, read by their tools and by users' code.
_.hook_out_is_single_residual_stream
_.final_rms
_.gated_mlp
_.is_caching
_.set_use_split_qkv_input
_.set_use_attn_in
_.set_use_attn_result
_.set_use_hook_mlp_in
_.b_V
_.b_O
_.reset_parameters
_.init_kwargs
unk_token_id
_.view_state

# Fields of records written to JSON (results.json, snapshots, history.json, validation.json).
norm_weighted_sum
fourth_sum
max_abs_logit_diff
calibrate_full_max_abs_logit_diff
shift_at_r_max_abs_logit_diff
calibrate_full_identity_deviation
calibrate_full_halves_max_abs_logit_diff
calibrate_full_halves_metric_change
reference_auroc
reference_mahalanobis
fitted_on
confidence_matching
predicted_slope
evaluations
n_train

# Public names the docs name; DepthControlProtocol's read-only settings and the verdicts' names.
rejudge_file
register_pairing
POOLED_FALSE_ALARM_RATE
requested_metrics
probe_mode
_.calibration_null
VERDICTS

# Frameworks' hooks: pytest's, mkdocs's, html.parser's; a demo's named result.
pytest_terminal_summary
pytestmark
on_files
_.handle_starttag
threshold_logits

# A test's stand-ins for a Hugging Face tokenizer and config, and fixtures a test requests.
_.pre_tokenizer
_.decoder
_.output_logits_soft_cap
halfway_registered
toys
