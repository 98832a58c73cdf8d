// Data: upload a JSONL file, clean it (the report: kept and dropped by reason), then tokenize it as `data --show`
// does, with every run of trained tokens highlighted (<mark class="trained">: what `data --show` puts between {+ +}).
import {get, post, upload} from "../api.js";
import {$, busy, el, listing, modelOptions, optionValues, setOptions, showCommand} from "../ui.js";

function stem(path) {
  return path.split("/").pop().replace(/\.jsonl$/, "");
}

function reportTable(report) {
  const rows = [el("tr", {}, ...["file", "lines", "read", "kept", "dropped"].map(h => el("th", {text: h})))];
  for (const [file, entry] of Object.entries(report.files)) {
    rows.push(el("tr", {class: "file-row"}, el("td", {text: file}), el("td", {text: entry.lines}),
                 el("td", {text: entry.read}), el("td", {class: "kept", text: entry.kept}),
                 el("td", {class: "dropped", text: entry.dropped_total})));
    for (const [reason, count] of Object.entries(entry.dropped)) {
      rows.push(el("tr", {class: "drop-reason", "data-reason": reason}, el("td", {text: `  dropped: ${reason}`}),
                   el("td"), el("td"), el("td"), el("td", {class: "count", text: count})));
    }
  }
  return rows;
}

function statsTable(stats) {
  const head = ["split", "examples", "tokens min", "median", "p95", "max", "truncated prompts", "truncated responses",
                "trained fraction", "dropped"];
  const rows = [el("tr", {}, ...head.map(h => el("th", {text: h})))];
  for (const [split, s] of Object.entries(stats)) {
    const dropped = Object.entries(s.dropped).map(([k, v]) => `${k} ${v}`).join(", ") || "none";
    rows.push(el("tr", {"data-split": split}, ...[split, s.count, s.lengths.min, s.lengths.median, s.lengths.p95,
      s.lengths.max, s.truncated_prompt, s.truncated_response, s.trained_fraction.toFixed(3), dropped]
      .map(v => el("td", {text: v}))));
  }
  return el("table", {class: "table"}, ...rows);
}

function example(entry, marks) {
  const text = el("pre", {class: "example", "data-index": entry.index});
  for (const [trained, part] of entry.spans) {
    text.append(trained ? el("mark", {class: "trained", title: `trained (${marks[0]} ${marks[1]} in data --show)`,
                                      text: part}) : document.createTextNode(part));
  }
  return el("div", {class: "example-box"},
            el("div", {class: "note", text: `example ${entry.index}: ${entry.n_trained} trained of ${entry.length} ` +
                                             "tokens"}), text);
}

async function refresh() {
  const [files, form] = await Promise.all([listing(), get("/api/form")]);
  // What clean writes (and curate's list of removed records) is not raw data to clean again.
  const raw = files.data.filter(name => !name.endsWith("_clean.jsonl") && !name.endsWith("/curate_removed.jsonl"));
  setOptions($("clean-inputs"), raw);
  setOptions($("data-config"), form.presets);
  setOptions($("data-model"), modelOptions(files));
  if (!$("data-config").value && form.presets.includes("configs/train/chat_tiny.yaml")) {
    $("data-config").value = "configs/train/chat_tiny.yaml";
  }
}

export function init() {
  $("upload-file").addEventListener("change", () => {
    const file = $("upload-file").files[0];
    if (file) $("upload-name").value = `data/${file.name}`;
  });
  $("upload-button").addEventListener("click", event => busy("data", event.target, async () => {
    const file = $("upload-file").files[0];
    if (!file) throw new Error("error: choose a file first");
    const result = await upload($("upload-name").value, file);
    $("upload-result").textContent = `${result.path}: ${result.lines} records, ${result.bytes} bytes`;
    await refresh();
    $("clean-inputs").value = result.path;
    $("clean-output").value = `data/${stem(result.path)}-clean`;
  }));
  for (const id of ["clean-inputs", "clean-path"]) {
    $(id).addEventListener("change", () => {
      const chosen = $(id).value.trim().replace(/\/$/, "");
      if (chosen) $("clean-output").value = `data/${stem(chosen)}-clean`;
    });
  }
  $("clean-button").addEventListener("click", event => busy("data", event.target, async () => {
    const path = $("clean-path").value.trim();
    const values = optionValues($("clean-form"));
    const result = await post("/api/clean", {...values, inputs: path ? [path] : values.inputs,
                                             output_dir: values.output_dir ?? ""});
    showCommand("data", result.command);
    $("clean-report").replaceChildren(...reportTable(result.report));
    $("data-dataset").value = result.output_dir;
  }));
  $("data-button").addEventListener("click", event => busy("data", event.target, async () => {
    const values = optionValues($("data-form"));
    const result = await post("/api/data", {...values, model_name: values.model_name ?? "",
                                             dataset_path: values.dataset_path ?? ""});
    showCommand("data", result.command);
    $("data-stats").replaceChildren(statsTable(result.stats), ...result.summary.map(s => el("div", {class: "note",
                                                                                                 text: s})));
    $("data-examples").replaceChildren(...result.examples.map(e => example(e, result.marks)));
  }));
}

export async function show() {
  await refresh();
}
