// Plan and train: a form built from the config blocks (GET /api/form: the fields, defaults and docs `train --help`
// lists), presets, `plan` and `check`, starting a run, and each run's curves live from its metrics.jsonl
// (server-sent events), with stop (SIGTERM: a checkpoint is written) and resume.
import {get, post} from "../api.js";
import {drawChart, formatNumber} from "../chart.js";
import {$, busy, el, listing, modelOptions, optionValues, setOptions, showCommand} from "../ui.js";

const OPEN_BLOCKS = ["model", "data source", "LoRA", "schedule", "checkpoints"];
let blocks = [];
let current = null;  // the run shown: {name, rows, events}
let maxSteps = null;  // the run shown's max_steps

// ------------------------------------------------------------------ the form

function input(field) {
  const attributes = {name: field.name, "data-kind": field.kind, id: `field-${field.name}`};
  if (field.kind === "bool") return el("input", {...attributes, type: "checkbox"});
  if (field.kind === "choice") {
    const select = el("select", attributes);
    setOptions(select, field.choices, field.optional ? "(unset)" : undefined);
    return select;
  }
  const placeholder = field.required ? "required" : field.optional ? "(unset)" : "";
  // model_name suggests what the other pages' model pickers offer (any other name or path may be typed)
  const suggestions = field.name === "model_name" ? {list: "model-choices"} : {};
  return el("input", {...attributes, ...suggestions, type: "text", placeholder, size: field.kind === "str" ? 36 : 14});
}

function buildForm() {
  $("train-form").replaceChildren(...blocks.map(block => {
    const [name] = block.title.split(":");
    const details = el("details", {"data-block": name}, el("summary", {text: block.title}));
    if (OPEN_BLOCKS.includes(name)) details.open = true;
    for (const field of block.fields) {
      // A field whose file is code the run will run (a reward module) says so where its value is typed.
      const warning = field.warning ? [el("p", {class: "warning", id: `warning-${field.name}`, text: field.warning})]
        : [];
      details.append(el("div", {class: "field"},
                        el("label", {for: `field-${field.name}`, text: field.name + (field.required ? " *" : "")}),
                        input(field), el("small", {class: "doc", text: field.doc}), ...warning));
    }
    return details;
  }), el("datalist", {id: "model-choices"}));
}

function setValue(field, value) {
  const element = $(`field-${field.name}`);
  if (field.kind === "bool") element.checked = Boolean(value);
  else if (value === null || value === undefined) element.value = "";
  else if (isJSON(field)) element.value = JSON.stringify(value);
  else if (Array.isArray(value)) element.value = value.join(", ");
  else element.value = String(value);
}

// A mapping, or a list of them (rewards), is typed as JSON.
const isJSON = field => field.kind === "dict" || field.kind === "mappings";

// The form's values as JSON: numbers where the text is one (the loader reads "5e-5" too), lists from commas,
// empty as unset. The server's loader checks the rest and says what is wrong in the CLI's words.
function readValue(field) {
  const element = $(`field-${field.name}`);
  if (field.kind === "bool") return element.checked;
  const text = element.value.trim();
  if (text === "") return field.kind === "list" || field.kind === "choices" ? (field.optional ? null : []) : null;
  if (field.kind === "int" || field.kind === "float") return Number.isFinite(Number(text)) ? Number(text) : text;
  if (field.kind === "list" || field.kind === "choices") return text.split(",").map(s => s.trim()).filter(Boolean);
  if (isJSON(field)) {
    try {
      return JSON.parse(text);
    } catch {
      return text;
    }
  }
  return text;
}

const fields = () => blocks.flatMap(block => block.fields);

export function formValues() {
  return Object.fromEntries(fields().map(field => [field.name, readValue(field)]));
}

export function fillForm(values) {
  for (const field of fields()) if (field.name in values) setValue(field, values[field.name]);
}

// A config saved from this form comes back under its name, with its own output_dir; a repository preset's run goes
// under the name typed.
async function loadPreset() {
  const preset = await get(`/api/presets?name=${encodeURIComponent($("train-preset").value)}`);
  if (preset.config_name) $("train-name").value = preset.config_name;
  fillForm(preset.config_name ? preset.values : {...preset.values, output_dir: `runs/${$("train-name").value}`});
}

async function saveConfig() {
  const saved = await post("/api/configs", {name: $("train-name").value, values: formValues()});
  showCommand("train", saved.command);
  return saved.path;
}

function launchBody(config) {
  const launcher = $("train-launcher").value;
  return {config, launcher, accelerate_config: launcher === "accelerate" ? $("train-accelerate-config").value || null
    : null, num_processes: launcher === "accelerate" && $("train-processes").value
    ? Number($("train-processes").value) : null, devices: $("train-devices").value,
          allow_concurrent: $("train-concurrent").checked};
}

// ------------------------------------------------------------------ runs

async function refreshRuns() {
  const {runs} = await get("/api/runs");
  const head = el("tr", {}, ...["run", "state", "step", "loss", "checkpoints", ""].map(h => el("th", {text: h})));
  $("runs-table").replaceChildren(head, ...runs.map(run => el("tr", {"data-run": run.name, "data-state": run.state},
    el("td", {text: run.name}), el("td", {class: "state", text: run.state}),
    el("td", {text: run.max_steps ? `${run.step} / ${run.max_steps}` : run.step}),
    el("td", {text: run.last ? formatNumber(run.last.loss) : "-"}),
    el("td", {text: run.checkpoints.join(", ") || "-"}),
    el("td", {}, el("button", {type: "button", text: "open", onclick: () => openRun(run.name)})))));
  return runs;
}

// The charts and the step counter, both from the rows of metrics.jsonl received so far, so that they agree.
function drawCharts() {
  const rows = current ? current.rows : [];
  const training = rows.filter(r => "loss" in r), validation = rows.filter(r => "val_loss" in r);
  const step = training.length ? training[training.length - 1].step : 0;
  $("run-step").textContent = maxSteps ? `${step} of ${maxSteps}` : String(step);
  const series = (key, list = training) => list.map(r => [r.step, r[key]]);
  drawChart($("chart-loss"), "loss", [{name: "train", color: "#1f77b4", points: series("loss")},
                                      ...(validation.length ? [{name: "validation", color: "#ff7f0e",
                                                                points: series("val_loss", validation)}] : [])]);
  drawChart($("chart-lr"), "learning rate", [{name: "lr", color: "#2ca02c", points: series("lr")}]);
  drawChart($("chart-grad"), "gradient norm", [{name: "grad_norm", color: "#9467bd", points: series("grad_norm")}]);
  drawChart($("chart-tps"), "tokens / s", [{name: "tokens_per_s", color: "#8c564b", points: series("tokens_per_s")}]);
  const gpu = training.some(r => "peak_gpu_mb" in r);
  drawChart($("chart-memory"), gpu ? "peak GPU memory (MiB)" : "peak host memory (MiB)",
            [{name: "memory", color: "#e377c2", points: series(gpu ? "peak_gpu_mb" : "peak_rss_mb")}]);
}

function showRun(info) {
  $("run-panel").hidden = false;
  $("run-name").textContent = info.name;
  $("run-state").textContent = info.state;
  $("run-state").dataset.state = info.state;
  maxSteps = info.max_steps;
  $("run-stop").disabled = info.state !== "running";
  $("run-resume").disabled = !info.resumable;
  $("run-report").hidden = !info.report;
  if (info.report) $("run-report").href = `/files/${info.report}`;
  $("run-command").textContent = [info.command && `${info.command}   # how it was started`,
                                  info.error].filter(Boolean).join("\n");
  if (info.log) {
    $("run-log").textContent = info.log.join("\n");
    $("run-log").scrollTop = $("run-log").scrollHeight;  // the newest lines
  }
}

// The run's rows and state as server-sent events; the stream ends (and is closed here) once the run stops.
function follow(name) {
  if (current && current.events) current.events.close();
  current = {name, rows: [], events: new EventSource(`/api/runs/${encodeURIComponent(name)}/events`)};
  const run = current;
  run.events.addEventListener("metrics", event => {
    run.rows.push(JSON.parse(event.data));
    if (run === current) drawCharts();
  });
  run.events.addEventListener("state", async event => {
    const info = JSON.parse(event.data);
    if (info.state !== "running") run.events.close();
    if (run !== current) return;
    showRun(await get(`/api/runs/${encodeURIComponent(name)}`));
    await refreshRuns();
  });
  drawCharts();
}

async function openRun(name) {
  const info = await get(`/api/runs/${encodeURIComponent(name)}`);
  showRun(info);
  if (!$("train-command").textContent && info.command) showCommand("train", info.command);
  follow(name);
}

// ------------------------------------------------------------------ the page

export function init() {
  $("train-load-preset").addEventListener("click", event => busy("train", event.target, loadPreset));
  $("train-name").addEventListener("change", () => {
    $("field-output_dir").value = `runs/${$("train-name").value}`;
  });
  $("train-plan").addEventListener("click", event => busy("train", event.target, async () => {
    const config = await saveConfig();
    const plan = await post("/api/plan", {...optionValues($("train-plan-form")), config});
    showCommand("train", [`${plan.command}`]);
    $("train-output").textContent = plan.text;
  }));
  $("train-check").addEventListener("click", event => busy("train", event.target, async () => {
    const config = await saveConfig();
    $("train-output").textContent = "checking (a 2-step dry run included)...";
    const check = await post("/api/check", {config});
    showCommand("train", check.command);
    $("train-output").textContent = [...check.lines, check.failed ? `${check.failed} failed` : "all checks passed"]
      .join("\n");
  }));
  $("train-start").addEventListener("click", event => busy("train", event.target, async () => {
    const config = await saveConfig();
    const run = await post("/api/runs", launchBody(config));
    showCommand("train", run.command);
    showRun(run);
    follow(run.name);
    await refreshRuns();
  }));
  $("run-stop").addEventListener("click", event => busy("train", event.target, async () => {
    showRun(await post(`/api/runs/${encodeURIComponent(current.name)}/stop`));
    $("run-stop").disabled = true;
  }));
  $("run-resume").addEventListener("click", event => busy("train", event.target, async () => {
    const run = await post(`/api/runs/${encodeURIComponent(current.name)}/resume`);
    showCommand("train", run.command);
    showRun(run);
    follow(run.name);
    await refreshRuns();
  }));
}

export async function show() {
  const form = await get("/api/form");
  setOptions($("train-preset"), form.presets);  // saved configs join the presets
  if (!blocks.length) {
    blocks = form.blocks;
    buildForm();
    if (form.presets.includes("configs/train/chat_tiny.yaml")) $("train-preset").value = "configs/train/chat_tiny.yaml";
    setOptions($("train-accelerate-config"), form.accelerate_configs, "(none)");
    await loadPreset();
  }
  setOptions($("model-choices"), modelOptions(await listing()));
  const pending = JSON.parse(sessionStorage.getItem("studio-train"));  // from the map page's "Train on ..."
  if (pending) {
    sessionStorage.removeItem("studio-train");
    if (pending.config && [...$("train-preset").options].some(o => o.value === pending.config)) {
      $("train-preset").value = pending.config;
    }
    await loadPreset();
    $("train-name").value = pending.name;  // a new run: not the one whose config it starts from
    fillForm({output_dir: `runs/${pending.name}`, dataset_path: pending.dataset_path});
  }
  const runs = await refreshRuns();
  if (!current && runs.length) await openRun(runs[runs.length - 1].name);
}
