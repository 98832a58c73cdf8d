// Export: `export` of a final/ or checkpoint as one GGUF file (with the chat template, for llama.cpp, GPT4All and
// Ollama) or a slim HF folder, with a download link per file.
import {runJob} from "../api.js";
import {$, busy, el, listing, modelOptions, optionValues, setOptions, showCommand} from "../ui.js";

function size(bytes) {
  const [unit, scale] = [["GB", 1e9], ["MB", 1e6], ["kB", 1e3]].find(([, s]) => bytes >= s) ?? ["bytes", 1];
  return `${scale === 1 ? bytes : (bytes / scale).toFixed(1)} ${unit}`;
}

function defaultTarget() {
  const source = $("export-source").value;
  if (!source) return;
  // runs/NAME/final -> NAME-final; a packaged model's short name as it is
  const stem = source.split("/").slice(-2).join("-");
  $("export-to").value = `exports/${stem}-${$("export-format").value}`;
}

export function init() {
  $("export-source").addEventListener("change", defaultTarget);
  $("export-format").addEventListener("change", defaultTarget);
  $("export-button").addEventListener("click", event => busy("export", event.target, async () => {
    const values = optionValues($("export-form"));
    const result = await runJob("export", {...values, source: values.source ?? "", to: values.to ?? ""},
                                job => {
                                  showCommand("export", job.commands);
                                  $("export-log").textContent = job.log.join("\n");
                                });
    $("export-files").replaceChildren(...result.files.map(file => el("li", {},
      el("a", {class: "download", href: `/files/${file.path}?download=1`, download: file.path.split("/").pop(),
               text: file.path}), ` ${size(file.bytes)}`)));
  }));
}

export async function show() {
  setOptions($("export-source"), modelOptions(await listing()));
  if (!$("export-to").value) defaultTarget();
}
