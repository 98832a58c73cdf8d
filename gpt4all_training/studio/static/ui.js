// Small helpers every page uses: finding and making elements, filling selects, the error line and the command box.
import {get} from "./api.js";

export const $ = id => document.getElementById(id);

export function el(tag, attributes = {}, ...children) {
  const element = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "class") element.className = value;
    else if (key === "text") element.textContent = value;
    else if (key.startsWith("on")) element.addEventListener(key.slice(2), value);
    else element.setAttribute(key, value);
  }
  element.append(...children);
  return element;
}

// Replace a select's options with `values` ([value] or [value, label]), keeping the current choice if still there.
export function setOptions(select, values, placeholder) {
  const current = select.value;
  const options = values.map(v => Array.isArray(v) ? v : [v, v]);
  select.replaceChildren(...(placeholder !== undefined ? [el("option", {value: "", text: placeholder})] : []),
                         ...options.map(([value, label]) => el("option", {value, text: label})));
  if (options.some(([value]) => value === current)) select.value = current;
}

// A form's values by input name, as its request body takes them (each name a CLI option's dest): a checkbox true
// or false, a number or null, a multiple select a list, the words of `data-list` inputs (and the ticked checkboxes
// marked so) one list per name, other text or null (null: the CLI's default).
export function optionValues(form) {
  const values = {};
  for (const input of form.querySelectorAll("[name]")) {
    const text = input.value.trim();
    if (input.type === "radio") continue;
    if (input.dataset.list !== undefined) {
      const words = input.type === "checkbox" ? (input.checked ? [input.value] : []) : text.split(/\s+/);
      values[input.name] = [...(values[input.name] ?? []), ...words.filter(Boolean)];
    } else if (input.type === "checkbox") values[input.name] = input.checked;
    else if (input.multiple) values[input.name] = [...input.selectedOptions].map(o => o.value);
    else if (input.type === "number") values[input.name] = text === "" ? null : Number(text);
    else values[input.name] = text === "" ? null : text;
  }
  return values;
}

// The page's one error line (the CLI's `error: ...`), or nothing.
export function showError(page, error) {
  $(`${page}-error`).textContent = error ? (error.message || String(error)) : "";
}

// The equivalent command line(s) of what the page did last.
export function showCommand(page, commands) {
  const lines = Array.isArray(commands) ? commands : [commands];
  $(`${page}-command`).textContent = lines.filter(Boolean).join("\n");
}

// Run `action` with `button` disabled; its error lands on the page's error line.
export async function busy(page, button, action) {
  button.disabled = true;
  showError(page, null);
  try {
    return await action();
  } catch (error) {
    showError(page, error);
  } finally {
    button.disabled = false;
  }
}

// The workdir's data files, configs, models, maps and exports (GET /api/files), for the pickers.
export const listing = () => get("/api/files");

// What a model picker offers ([value, label]): the packaged models by their short names, read from their package,
// then the workdir's models (models/NAME/, runs' final/ and checkpoints).
export function packagedOptions(files) {
  return files.packaged.map(p => [p.name, `${p.name}: ${p.description}, packaged` +
                                          (p.install ? `, not installed (${p.install})` : "")]);
}

export const modelOptions = files => [...packagedOptions(files), ...files.models];
