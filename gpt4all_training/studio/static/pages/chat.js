// Chat: a conversation with any final/ or checkpoint through the serving engine, the reply streamed as it is
// decoded. The same model served for scripts: `gpt4all-training serve --model PATH` (OpenAI's API).
import {postStream} from "../api.js";
import {$, busy, el, listing, modelOptions, setOptions, showCommand} from "../ui.js";

let messages = [];

function bubble(role, text) {
  const box = el("div", {class: `message ${role}`}, el("span", {class: "role", text: role}),
                 el("span", {class: "content", text}));
  $("chat-log").append(box);
  return box.querySelector(".content");
}

function updateCommand() {
  const model = $("chat-model").value;
  if (model) showCommand("chat", `gpt4all-training serve --model ${model}   # then any OpenAI client, streaming`);
}

export function init() {
  $("chat-model").addEventListener("change", () => {
    messages = [];
    $("chat-log").replaceChildren();
    updateCommand();
  });
  $("chat-clear").addEventListener("click", () => {
    messages = [];
    $("chat-log").replaceChildren();
  });
  $("chat-form").addEventListener("submit", event => {
    event.preventDefault();
    busy("chat", $("chat-send"), async () => {
      const text = $("chat-input").value.trim();
      if (!text) return;
      $("chat-input").value = "";
      messages.push({role: "user", content: text});
      bubble("user", text);
      const reply = bubble("assistant", "");
      reply.parentElement.dataset.state = "streaming";
      let answer = "";
      try {
        await postStream("/api/chat", {model: $("chat-model").value, messages,
                                       temperature: Number($("chat-temperature").value),
                                       max_tokens: Number($("chat-max-tokens").value)}, event => {
          if (event.error) throw new Error(event.error);
          if (event.delta) {
            answer += event.delta;
            reply.textContent = answer;
            reply.parentElement.dataset.chunks = String(Number(reply.parentElement.dataset.chunks || 0) + 1);
          }
          if (event.done) reply.parentElement.dataset.finish = event.finish_reason;
        });
        messages.push({role: "assistant", content: answer});
      } catch (error) {
        messages.pop();
        reply.parentElement.remove();
        throw error;
      } finally {
        reply.parentElement.dataset.state = "done";
      }
    });
  });
}

export async function show() {
  setOptions($("chat-model"), modelOptions(await listing()));
  updateCommand();
}
